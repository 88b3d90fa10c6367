"""The sinklab-vllm plugin against sinklab's ``SinkCache`` on Qwen2.5 (docs/vllm.md#wiring-tests):
1,000 tokens past the first eviction with 4 + 252 kept (the issue's sizes), alone, blocks of 32.
Its own file so that xdist (one file a worker) runs it beside tests/test_vllm_stream.py and
tests/test_vllm.py."""

from __future__ import annotations

import pytest

from vllm_helpers import stream_check

pytestmark = pytest.mark.vllm


@pytest.mark.integration
def test_the_plugin_streams_exactly_as_sinklab_on_qwen25_alone_small_blocks(vllm_py):
    from sinklab.models.loading import load_model

    qwen = load_model("qwen2.5-0.5b")
    stream_check(vllm_py, qwen, n_sink=4, window=252, block_size=32, together=False)
