"""Data strategies: where BOS sits, and that doc-mask blocks attention across documents."""

from __future__ import annotations

import pytest
import torch

from sinklab.errors import SinklabError
from sinklab.lab.data import BOS_ID, DATA_STRATEGIES, DataConfig, LabData, document_mask


@pytest.fixture(scope="session")
def lab_data() -> dict[str, LabData]:
    first = LabData(DataConfig(strategy="bos", seq_len=32, vocab_size=320, max_docs=12))
    out = {"bos": first}
    for s in DATA_STRATEGIES[1:]:
        cfg = DataConfig(strategy=s, seq_len=32, vocab_size=320, max_docs=12)
        out[s] = LabData(cfg, tokenizer=first.tokenizer)
    return out


def test_bos_batches_start_with_bos_and_packed_has_none(lab_data):
    bos, packed = lab_data["bos"], lab_data["packed"]
    assert (bos.ids[:, 0] == BOS_ID).all() and (bos.ids[:, 1:] != BOS_ID).all()
    assert (packed.ids != BOS_ID).all()
    batch = packed.batch(packed.batch_order(3, 4, seed=0)[2])
    assert (batch["input_ids"] != BOS_ID).all() and "attention_mask" not in batch


def test_packed_bos_marks_every_document_start(lab_data):
    d = lab_data["packed-bos"]
    starts = d.ids == BOS_ID
    changes = torch.zeros_like(starts)
    changes[:, 1:] = d.doc[:, 1:] != d.doc[:, :-1]
    assert (starts[:, 1:] == changes[:, 1:]).all()  # BOS exactly where a new document begins
    assert starts.sum() >= len(d.train_docs) - 1


def test_doc_mask_blocks_cross_document_attention(lab_data):
    d = lab_data["doc-mask"]
    rows = torch.nonzero(d.doc[:, 0] != d.doc[:, -1])[:4, 0]  # windows crossing a boundary
    assert rows.numel() > 0
    batch = d.batch(rows)
    mask = batch["attention_mask"][:, 0]  # (B, T, T)
    doc = d.doc[rows]
    same = doc[:, :, None] == doc[:, None, :]
    causal = torch.ones(32, 32, dtype=torch.bool).tril()
    assert torch.equal(mask, same & causal)
    assert not mask[~same].any() and mask.diagonal(dim1=1, dim2=2).all()
    assert torch.equal(document_mask(doc)[:, 0], mask)


def test_batch_order_is_deterministic(lab_data):
    d = lab_data["bos"]
    assert torch.equal(d.batch_order(5, 3, 7), d.batch_order(5, 3, 7))
    assert not torch.equal(d.batch_order(5, 3, 7), d.batch_order(5, 3, 8))


def test_eval_windows_prefix(lab_data):
    p, text = lab_data["bos"].eval_windows(4)
    assert (p == BOS_ID).all() and text.shape[1] == 31
    p, _ = lab_data["packed"].eval_windows(4)
    assert (p != BOS_ID).all()


def test_bad_strategy_is_one_error():
    with pytest.raises(SinklabError, match="data strategy"):
        DataConfig(strategy="shuffled")
