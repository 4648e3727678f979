"""SmolLM2-135M-Instruct chats through its own template (issue 42 item 4), in-process and
over the wire: the rendered prompt is transformers' (``tests/data/smollm2_golden.json``),
the greedy answer is transformers' float64 answer up to and including ``<|im_end|>``,
where the chat stops, and a server of the GGUF file (whose tokenizer has no
``tokenizer.json``) renders the same chat for a client. One runtime, one test: SmolLM2
loads in 10-20 s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
import zmq

from spectrio import RuntimeConfig, SamplingParams, SpeculativeConfig, open_runtime
from spectrio.models import LoadedModel, load
from spectrio.wire.async_client import open_client
from spectrio.wire.server import WireServer, serve

GOLDEN = json.loads((Path(__file__).resolve().parent / "data" / "smollm2_golden.json").read_text())


@pytest.fixture(scope="module")
def smol64(smollm2_gguf: Path) -> LoadedModel:
    return load(smollm2_gguf, dtype="float64")


async def test_smollm2_chats_as_transformers_does_and_stops_at_im_end(
    smol64: LoadedModel, tmp_path: Path
) -> None:
    chat = [{"role": "user", "content": GOLDEN["chats"][0]}]  # the capital of France
    golden = GOLDEN["token_ids"][0]
    end = golden.index(2) + 1  # <|im_end|> (id 2, also EOS) closes the answer
    cfg = RuntimeConfig(
        model="smollm2",
        dtype="float64",
        max_model_len=256,
        max_num_seqs=2,
        max_num_batched_tokens=512,
        speculative=SpeculativeConfig(method=None),
    )
    params = SamplingParams(max_tokens=GOLDEN["new_tokens"])
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with trio.fail_after(300):
            async with open_runtime(cfg, loaded=smol64, warmup=False) as rt:
                prompt, chat_params = rt.chat_prompt(chat, params)
                assert prompt == GOLDEN["prompt_ids"][0]
                assert 2 in chat_params.stop_token_ids
                deltas = [d async for d in rt.chat(chat, params)]
                tokens = [t for d in deltas for t in d.token_ids]
                assert tokens == golden[:end] and deltas[-1].finish_reason == "stop"
                text = "".join(d.text for d in deltas)
                assert text == "The capital of France is Paris."
                run_dir = tmp_path / "run"
                run_dir.mkdir(mode=0o700)
                async with trio.open_nursery() as nursery:
                    server = await nursery.start(
                        lambda task_status=trio.TASK_STATUS_IGNORED: serve(  # type: ignore[misc]
                            rt,
                            f"ipc://{run_dir}/req",
                            f"ipc://{run_dir}/out",
                            context=ctx,
                            task_status=task_status,
                        )
                    )
                    assert isinstance(server, WireServer) and server.endpoints is not None
                    eps = server.endpoints
                    async with open_client(eps.requests, eps.outputs, context=ctx) as client:
                        assert (await client.info()).chat_template
                        rid = await client.submit(params=params, messages=chat)
                        chunks = (await client.collect([rid]))[rid]
                    assert [t for c in chunks for t in c.token_ids] == tokens
                    assert "".join(c.text for c in chunks) == text
                    assert chunks[-1].finish_reason == "stop"
                    nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
