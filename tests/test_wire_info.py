"""Issue 13, "Model info": the ``Info`` request (wire schema 1.2) over a real
``spectrio serve`` process, read by the client library and by plain msgpack, and the
client library detokenising with the server's tokenizer rather than the bundled one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgpack
import pytest
import zmq
from test_serve_process import Server

from spectrio.core.params import SamplingParams
from spectrio.models import BUNDLED_DIR, load
from spectrio.wire.client_tokenizers import bundled_tokenizer, tokenizer_for
from spectrio.wire.schema import SCHEMA_MINOR, ModelInfo, SpeculativeInfo
from spectrio.wire.sync_client import Client

BUNDLED_JSON = (Path(BUNDLED_DIR) / "tokenizer.json").read_bytes()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> object:
    tmp = tmp_path_factory.mktemp("info")
    srv = Server(
        tmp,
        "serve",
        "--run-dir",
        str(tmp / "run"),
        "--k",
        "3",
        "--no-adaptive",
        "--max-model-len",
        "256",
    )
    try:
        srv.wait_endpoints()
        yield srv
    finally:
        srv.stop()


def test_info_round_trip_over_a_real_server(server: Server) -> None:
    eps = server.endpoints
    assert eps is not None
    loaded = load("bundled")
    assert loaded.tokenizer is not None
    with Client(eps["requests"], timeout_s=30) as client:
        info = client.info()
        assert info == ModelInfo(
            minor=SCHEMA_MINOR,
            model="bundled",
            vocab_size=loaded.config.vocab_size,
            max_model_len=256,
            eos_token_id=loaded.tokenizer.eos_token_id,
            speculative=SpeculativeInfo(
                method="mtp",
                num_speculative_tokens=3,
                num_model_steps=None,
                adaptive=False,
                prompt_lookup_max=4,
                prompt_lookup_min=2,
            ),
            tokenizer_sha256=hashlib.sha256(BUNDLED_JSON).hexdigest(),
            tokenizer_bytes=len(BUNDLED_JSON),
            healthy=True,  # since 1.7: an idle pipeline is healthy
            output_stall_s=10.0,  # the default bound (--output-stall-s)
        )
        assert info.tokenizer_json is None  # only when asked for: it is large
        full = client.info(tokenizer=True)
        assert full.tokenizer_json is not None
        assert full.tokenizer_json.encode("utf-8") == BUNDLED_JSON
        assert tokenizer_for(full) is bundled_tokenizer()  # same content, same object


def test_info_from_plain_msgpack(server: Server) -> None:
    """docs/wire.md only: a DEALER, a msgpack map, a msgpack map back."""
    eps = server.endpoints
    assert eps is not None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(eps["requests"])
        sock.send(msgpack.packb({"type": "info", "v": 1}))
        reply = msgpack.unpackb(sock.recv())
        assert reply["type"] == "info" and reply["v"] == 1 and reply["minor"] == SCHEMA_MINOR
        assert reply["speculative"]["num_speculative_tokens"] == 3
        assert reply["tokenizer_json"] is None and reply["max_model_len"] == 256
        sock.send(msgpack.packb({"type": "info", "v": 1, "tokenizer": "yes"}))
        assert msgpack.unpackb(sock.recv())["code"] == "wrong_type"
        sock.send(msgpack.packb({"type": "info", "v": 1, "tokenizer": True}))
        assert msgpack.unpackb(sock.recv())["tokenizer_json"].encode() == BUNDLED_JSON
    finally:
        sock.close()
        ctx.term()


def test_the_client_uses_the_servers_tokenizer(tmp_path: Path) -> None:
    """A server whose tokenizer file differs from the bundled one (the same tokenizer,
    written with other whitespace, so a different hash): a client with no tokenizer of
    its own fetches the server's, once, and decodes with it."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).symlink_to(Path(BUNDLED_DIR) / name)
    served = json.dumps(json.loads(BUNDLED_JSON), indent=1)
    (model / "tokenizer.json").write_text(served)
    digest = hashlib.sha256(served.encode()).hexdigest()
    srv = Server(tmp_path, "serve", "--run-dir", str(tmp_path / "run"), "--model", str(model))
    try:
        eps = srv.wait_endpoints()
        with Client(eps["requests"], eps["outputs"], timeout_s=60) as client:
            info = client.info()
            assert info.tokenizer_sha256 == digest and info.model == str(model)
            assert tokenizer_for(info) is None  # this process does not have it yet
            chunks = list(client.generate("def f(x):", SamplingParams(max_tokens=6)))
            tok = client.assembler.tokenizer
            assert tok is not bundled_tokenizer() and tok is tokenizer_for(info)
            ids = [t for c in chunks for t in c.token_ids]
            assert "".join(c.text for c in chunks) == tok.decode(ids)
            assert chunks[-1].total_drafts is not None  # and the final step's totals
    finally:
        srv.stop()


def test_tokenizer_for_checks_the_hash() -> None:
    info = ModelInfo(
        model="m",
        vocab_size=1,
        max_model_len=2,
        eos_token_id=None,
        speculative=SpeculativeInfo(
            method=None, num_speculative_tokens=2, num_model_steps=None, adaptive=True
        ),
        tokenizer_sha256="00" * 32,
        tokenizer_bytes=len(BUNDLED_JSON),
    )
    assert tokenizer_for(info) is None
    bad = ModelInfo(**{**_fields(info), "tokenizer_json": BUNDLED_JSON.decode()})
    with pytest.raises(ValueError, match="does not match"):
        tokenizer_for(bad)


def _fields(info: ModelInfo) -> dict[str, object]:
    import msgspec

    return msgspec.structs.asdict(info)


def test_info_names_the_ngram_method_and_its_lookup_lengths() -> None:
    """``--spec-method ngram`` (schema 1.4): the reply says which proposer drafts, with
    its suffix lengths, so a client can tell the methods apart."""
    from types import SimpleNamespace

    from spectrio.tools.cli.runtime_flags import parse_runtime_flags
    from spectrio.wire.server import model_info

    config = parse_runtime_flags(["--spec-method", "ngram", "--prompt-lookup-max", "3"])
    runtime = SimpleNamespace(
        config=config,
        loaded=SimpleNamespace(config=SimpleNamespace(vocab_size=7)),
        tokenizer=SimpleNamespace(eos_token_id=None),
        chat_template=None,
    )
    info = model_info(runtime, "{}")  # type: ignore[arg-type]
    assert info.speculative == SpeculativeInfo(
        method="ngram",
        num_speculative_tokens=4,
        num_model_steps=None,
        adaptive=True,
        prompt_lookup_max=3,
        prompt_lookup_min=2,
    )
