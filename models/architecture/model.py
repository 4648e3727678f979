"""The target decoder and its DeepSeek-V3-style MTP draft layer, in one Paddle module: built
(:func:`build_model`), run over a paged cache (serving) or dense (training and the oracle).
Its output head's serving layouts are :mod:`~spectrio.models.architecture.head`'s, the MTP
layer :mod:`~spectrio.models.architecture.mtp_layer`'s."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from spectrio.models.ops.paddle_setup import configure_paddle, paddle  # first: imports Paddle

# isort: split
from paddle import nn

from spectrio.models.architecture.batch import AttentionPlan, LayerRows, PackedBatch
from spectrio.models.architecture.config import DType, ModelConfig
from spectrio.models.architecture.head import HeadLayouts
from spectrio.models.architecture.kv_cache import PagedKVCache
from spectrio.models.architecture.layers import (
    KV,
    DecoderLayer,
    RMSNorm,
    RopeRows,
    rope_cos_sin,
    rope_matrices,
)
from spectrio.models.architecture.mtp_layer import MTPLayer
from spectrio.models.loading.mtp_layout import layout_of
from spectrio.models.ops import fast_ops as fo
from spectrio.models.ops import native_ops
from spectrio.models.ops.serving_matrix import ServingMatrix
from spectrio.models.ops.staging import Staging
from spectrio.process_memory import trim_freed_memory


@dataclasses.dataclass
class ForwardOutput:
    logits: paddle.Tensor  # [M, V] for the requested rows
    #: [N, d] for every row: the state the MTP layer reads next (the target's final
    #: hidden state, normed or not as the MTP layout wants; the MTP layer's output)
    hidden: paddle.Tensor
    #: [M, d]: the rows of ``hidden`` the logits are for, where the pass gathered them
    #: anyway (the MTP pass), so the next draft substep need not gather them again
    picked_hidden: paddle.Tensor | None = None
    #: ``logits`` column j is token ``vocab_ids[j]``; None: column j is token j (the MTP
    #: pass over a draft vocabulary, :meth:`SpectrioForCausalLM.set_draft_vocab`)
    vocab_ids: np.ndarray | None = None


class DecoderModel(nn.Layer):
    """Embedding, the decoder stack and the final norm (Hugging Face ``model.*``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.LayerList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class SpectrioForCausalLM(nn.Layer):
    """Target language model plus (optionally) its MTP layer.

    Hidden states handed to the MTP layer are the target's final, normed hidden
    states; the MTP layer's own output hidden state (before ``shared_head.norm``)
    is what the next MTP substep consumes. A checkpoint whose MTP layer was built
    otherwise (``config.mtp_layout``) switches either: MiMo's reads the target's state
    before its final norm, and MiMo's and ERNIE's end in their norm, so the next
    substep reads the normed state (:mod:`spectrio.models.loading.mtp_layout`).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        configure_paddle()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias_attr=False)
        )
        self.mtp = MTPLayer(cfg) if cfg.has_mtp else None
        self._init_serving_state()

    def _init_serving_state(self) -> None:
        """What the serving path keeps besides the weights (a tensor-parallel shard's
        model sets it up too)."""
        self.serving_only = False  # prepare_serving(release=True) freed the unfused weights
        self._rope_table: paddle.Tensor | None = None  # [P, D, D], P: the positions in use
        self._rope_halves: tuple[paddle.Tensor, paddle.Tensor] | None = None  # [P, D/2] each
        #: run each decoder layer as two native ops where they can (``forward_native``);
        #: False keeps the op-by-op Paddle path (the float64 path always takes it)
        self.native_layers = native_ops.native_layers_enabled()
        self._inv_freq_cache: np.ndarray | None = None
        self._head = HeadLayouts()  # the head for serving, in the layout each matmul wants
        self.draft_vocab: np.ndarray | None = None  # token ids the MTP pass drafts from
        self._draft_head = HeadLayouts(self.draft_half)  # its rows of the head
        #: the GGUF type the MTP pass's weights are quantized to (draft_from_blocks);
        #: None: float16 (or float32) panels
        self._draft_blocks: str | None = None
        layout = layout_of(self.config)
        self._mtp_reads_prenorm = layout.reads_prenorm
        self._mtp_norm_in_layer = layout.norm_in_layer
        self.staging = Staging()  # persistent input buffers (models/ops/staging.py)
        #: ``rows(ids)``: float32 ``[len(ids), d]`` rows of the embedding / the output head
        #: computed from elsewhere (a GGUF file's blocks, dequantized row by row) when the
        #: parameters hold no storage (:meth:`serve_rows_from`); None: the parameters
        self._embed_rows: Callable[[paddle.Tensor], paddle.Tensor] | None = None
        self._head_rows: Callable[[np.ndarray], np.ndarray] | None = None
        # Held for a serving pass: runtimes sharing this model (open_runtime's ``loaded``)
        # take turns, since a pass stages its inputs in ``staging``.
        self.step_lock = threading.Lock()

    def _decoder_layers(self) -> list[DecoderLayer]:
        """The target's layers, then the MTP layer when there is one."""
        return [*self.model.layers, *([self.mtp] if self.mtp is not None else [])]

    def prepare_serving(self, release: bool = False) -> None:
        """Build every layer's fused serving weights now instead of in the first step.

        ``release`` also frees the separate projection weights they replace (about 40%
        of a Llama's non-embedding weights): the model then only serves. Training, the
        dense forward, saving and :meth:`drop_serving_cache` raise ``RuntimeError``
        naming why, instead of reading freed weights."""
        for layer in self._decoder_layers():
            layer.prepare_serving(release)
            if release:  # layer by layer, so the freed weights and the fused never add up
                trim_freed_memory()
        self.serving_only = self.serving_only or release

    def require_weights(self, what: str) -> None:
        """Raise ``RuntimeError`` when :meth:`prepare_serving` released weights ``what``
        needs."""
        if self.serving_only:
            raise RuntimeError(
                f"{what}: this model was loaded for serving only (load(..., serving=True)), "
                "which frees the unfused projection weights; load it again without serving"
            )

    def train(self) -> SpectrioForCausalLM:  # type: ignore[override]
        """Training changes the weights, so the fused serving copies of them are dropped."""
        self.require_weights("train()")
        self.drop_serving_cache()
        super().train()
        return self

    def drop_serving_cache(self) -> None:
        """Forget what the serving path derives from the weights (fused projections, RoPE
        tables); call it after changing weights in place outside training."""
        self.require_weights("drop_serving_cache()")
        self._rope_table = self._rope_halves = None
        self._head = HeadLayouts()
        self._draft_head = HeadLayouts(self.draft_half)
        for layer in self._decoder_layers():
            layer.drop_fused()

    @property
    def dtype(self) -> DType:
        name = str(self.model.embed_tokens.weight.dtype).replace("paddle.", "")
        if name not in ("float32", "float64"):
            raise RuntimeError(f"model weights are {name}; only float32 and float64 run")
        return name  # type: ignore[return-value]  # narrowed by the check above

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Logits of ``hidden``. Without autograd they come from :class:`HeadLayouts` of
        the head, so a weight changed in place outside :meth:`train` needs
        :meth:`drop_serving_cache` (as the fused projections already did)."""
        if paddle.is_grad_enabled():
            if self.lm_head is None:
                return paddle.matmul(hidden, self.model.embed_tokens.weight, transpose_y=True)
            return self.lm_head(hidden)
        if self._head.empty:
            if self.lm_head is None:  # tied: the embedding, [V, d]
                self._head.set_rows(self.model.embed_tokens.weight.detach())
            else:
                self._head.set_columns(self.lm_head.weight.detach())
        return self._head.logits(hidden)

    def set_draft_vocab(self, token_ids: np.ndarray | None) -> None:
        """Draft from ``token_ids`` only: the MTP pass computes logits for those head rows
        and no others (None: the whole vocabulary). With a large vocabulary the head is
        most of a draft substep's work, and the tokens a model emits are concentrated on
        a small share of it, so drafting over the frequent ones costs a fraction and
        loses only drafts that would have been rare tokens. Verification is unchanged:
        output stays lossless whatever is drafted."""
        if token_ids is not None:
            token_ids = np.asarray(token_ids, dtype=np.int64)
            if token_ids.ndim != 1 or token_ids.size == 0:
                raise ValueError("the draft vocabulary is a non-empty list of token ids")
            if token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size:
                raise ValueError("draft vocabulary ids must lie in the model's vocabulary")
        self.draft_vocab = token_ids
        self._draft_head = HeadLayouts(self.draft_half)

    @property
    def draft_half(self) -> bool:
        """Whether the MTP pass multiplies by float16 copies of its weights (the MTP layer
        and the draft vocabulary's head rows; float32 models only)."""
        return self.mtp is not None and self.mtp.half_weights

    def set_draft_precision(self, half: bool) -> None:
        """Draft with float16 (``half``) or full-precision copies of the MTP pass's
        weights. Float16 reads half the bytes of a memory-bound substep; the drafts
        may differ where two tokens' logits are within its rounding, which moves the
        acceptance, never the output (verification runs in full precision). The copies
        are rebuilt from the weights, which a serving-only model has released."""
        if self.mtp is None or self.mtp.half_weights == half:
            return
        self.require_weights("set_draft_precision()")
        self.mtp.half_weights = half
        self.mtp.drop_fused()
        self._draft_head = HeadLayouts(half)

    def draft_from_blocks(self, type_name: str) -> None:
        """Draft from GGUF blocks of ``type_name`` quantized from the MTP pass's weights
        (the MTP layer, ``eh_proj`` and the draft vocabulary's head rows) instead of
        float16 panels: a draft substep then reads about half the bytes (Q8_0). Only the
        drafts depend on them; verification is the target's. Before
        :meth:`prepare_serving` releases the weights, where the native layers run."""
        from spectrio.models.ops.gguf_blocks import BLOCK_TYPES

        if self.mtp is None:
            return
        attn, mlp = self.mtp.self_attn, self.mtp.mlp
        inputs = (
            self.config.hidden_size,
            attn.num_heads * attn.head_dim,
            mlp.down_proj.weight.shape[0],
        )
        if any(k % BLOCK_TYPES[type_name].elements for k in inputs):
            return  # rows that are not whole blocks (a narrow shard's): panels, as before
        self.mtp.quantize_serving(type_name)
        self.mtp._eh_weight = ServingMatrix.quantized(self.mtp.eh_proj.weight.numpy().T, type_name)
        self._draft_blocks = type_name
        self._draft_head = HeadLayouts(self.draft_half)

    def compute_draft_logits(
        self, hidden: paddle.Tensor
    ) -> tuple[paddle.Tensor, np.ndarray | None]:
        """Logits of ``hidden`` over the draft vocabulary, and the token id of each column
        (None: the whole vocabulary, column j is token j)."""
        if self.draft_vocab is None or paddle.is_grad_enabled():
            return self.compute_logits(hidden), None
        if self._draft_head.empty and self._head_rows is not None:
            # packed at once: the float rows are not kept
            rows = self._head_rows(self.draft_vocab)
            self._draft_head.set_matrix(
                ServingMatrix(rows, rows=True, half=self.draft_half)
                if self._draft_blocks is None
                else ServingMatrix.quantized(rows, self._draft_blocks)
            )
            del rows
            trim_freed_memory()
        elif self._draft_head.empty:
            ids = paddle.to_tensor(self.draft_vocab)
            if self.lm_head is None:
                self._draft_head.set_rows(paddle.gather(self.model.embed_tokens.weight, ids))
            else:
                self._draft_head.set_columns(
                    paddle.gather(self.lm_head.weight, ids, axis=1).contiguous()
                )
        return self._draft_head.logits(hidden), self.draft_vocab

    def serve_rows_from(
        self,
        embed: Callable[[paddle.Tensor], paddle.Tensor],
        head: Callable[[np.ndarray], np.ndarray],
        head_matrix: ServingMatrix,
    ) -> None:
        """Serve the embedding and the head from outside the parameters (a GGUF file's
        blocks): ``embed(ids)`` (int64, staged) and ``head(ids)`` give float32 rows of
        the embedding and of the head, ``head_matrix`` the whole head's product. The
        parameters they replace stay without storage, so only the serving forward
        runs."""
        self._embed_rows, self._head_rows = embed, head
        self._head.set_matrix(head_matrix)
        self._draft_head = HeadLayouts(self.draft_half)
        self.serving_only = True

    def _embed(self, ids: np.ndarray) -> paddle.Tensor:
        """Embedding rows of ``ids`` (a row gather: ``nn.Embedding`` without its Python
        wrapper)."""
        if self._embed_rows is not None:
            return self._embed_rows(self.staging.put(np.asarray(ids, dtype=np.int64)))
        return fo.gather(self.model.embed_tokens.weight, self.staging.put(ids))

    def _inv_freq(self) -> np.ndarray:
        if self._inv_freq_cache is None:
            self._inv_freq_cache = self.config.inv_freq()
        return self._inv_freq_cache

    def _check_positions(self, last: int) -> None:
        limit = self.config.position_limit
        if limit is not None and last >= limit:
            raise ValueError(
                f"position {last} is past this model's {limit} positions (its dynamic RoPE "
                "scaling changes every frequency beyond them)"
            )

    def _rope(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        if positions.size:
            self._check_positions(int(positions.max()))
        return rope_cos_sin(positions, self._inv_freq(), self.dtype)

    def _rope_rows(self, positions: np.ndarray) -> RopeRows:
        """Rotation matrices for ``positions``, looked up in a table built once per model."""
        cfg = self.config
        if positions.size and int(positions.max()) >= cfg.max_position_embeddings:
            cos, sin = self._rope(paddle.to_tensor(positions))
            return RopeRows(paddle.to_tensor(rope_matrices(cos.numpy(), sin.numpy())))
        need = int(positions.max()) + 1 if positions.size else 1
        if self._rope_table is None or self._rope_table.shape[0] < need:
            # Grown by doubling to the positions in use, not built for the whole context
            # window: [P, D, D] matrices are 134 MB for SmolLM2's 8,192 positions, most of
            # which a runtime's max_model_len never reaches. A position's matrix does not
            # depend on the table's size.
            size = min(cfg.max_position_embeddings, max(256, 1 << (need - 1).bit_length()))
            span = paddle.arange(size, dtype="int64")
            cos, sin = rope_cos_sin(span, self._inv_freq(), self.dtype)
            self._rope_table = paddle.to_tensor(rope_matrices(cos.numpy(), sin.numpy()))
        return RopeRows(fo.gather(self._rope_table, self.staging.put(positions)))

    def _rope_tables(self, positions: np.ndarray) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos/sin ``[P, D/2]`` of positions ``0..P-1``, P covering ``positions``: the
        native layer op's tables, built in float64 from the inverse frequencies and grown
        by doubling (a position's row does not depend on the table's size)."""
        need = int(positions.max()) + 1 if positions.size else 1
        if need > 1:
            self._check_positions(need - 1)
        if self._rope_halves is None or self._rope_halves[0].shape[0] < need:
            size = max(256, 1 << (need - 1).bit_length())
            freqs = np.arange(size, dtype=np.float64)[:, None] * self._inv_freq()[None, :]
            self._rope_halves = (
                paddle.to_tensor(np.cos(freqs).astype(np.float32)),
                paddle.to_tensor(np.sin(freqs).astype(np.float32)),
            )
        return self._rope_halves

    def _native(
        self, layers: list[DecoderLayer], cache: PagedKVCache
    ) -> list[native_ops.LayerInputs] | None:
        """The layers' inputs to the native ops where ``layers`` run as native ops in this
        pass, else None."""
        if not self.native_layers or cache.dtype != "float32" or paddle.is_grad_enabled():
            return None
        inputs = [layer.native_inputs() for layer in layers]
        return None if None in inputs else inputs  # type: ignore[return-value]

    def _bound(
        self, inputs: list[native_ops.LayerInputs], cache: PagedKVCache
    ) -> native_ops.BoundLayers:
        """``inputs`` bound to ``cache``'s pools, as the layer op takes them: kept on the
        cache between passes (a pass over the same layers and pools reuses it; other
        layers, or weights packed again, bind anew)."""
        pools = [cache.pools(i) for i in range(len(inputs))]
        kept = cache.bound_layers.get(len(inputs))
        if kept is None or not kept.binds(inputs, [p[0] for p in pools]):
            kept = cache.bound_layers[len(inputs)] = native_ops.bind_layers(inputs, pools)
        return kept

    def _run_layers(
        self, layers: list[DecoderLayer], x: paddle.Tensor, batch: PackedBatch, cache: PagedKVCache
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``layers`` (cache layer i for the i-th) over the paged batch from input ``x``:
        as native ops where they run, else op by op. Returns ``(x', delta)`` whose sum is
        the last layer's output, each layer's biases already added."""
        delta: paddle.Tensor | None = None
        inputs = self._native(layers, cache)
        if inputs is not None:
            rows = LayerRows.build(
                batch, cache.block_size, self._rope_tables(batch.positions), self.staging.put
            )
            first = inputs[0]
            if not any(layer.partial_sums for layer in layers) and all(
                (i.heads, i.intermediate, i.eps) == (first.heads, first.intermediate, first.eps)
                for i in inputs
            ):  # one op for the whole run (its layers share their sizes)
                x, delta = native_ops.decoder_layers(
                    x, self._bound(inputs, cache), None, rows.rope, rows.as_tuple, cache.block_size
                )
                bias = inputs[-1].down_bias
                return x, delta if bias is None else fo.add(delta, bias)
            bias = None
            for i, layer in enumerate(layers):
                x, delta, bias = layer.forward_native(x, delta, bias, rows, cache, i)
            assert delta is not None, "at least one layer"
            return x, delta if bias is None else fo.add(delta, bias)
        plan = AttentionPlan.build(batch, cache, self.dtype, self.staging.put)
        rope = self._rope_rows(batch.positions)
        for i, layer in enumerate(layers):
            x, delta = layer.forward_paged(x, rope, plan, cache, i, delta)
        assert delta is not None, "at least one layer"
        return x, delta

    def _select(self, hidden: paddle.Tensor, batch: PackedBatch) -> paddle.Tensor:
        """The rows of ``hidden`` the batch wants logits for (``hidden`` itself where it
        wants every row, as a decode step and a draft substep do: no gather op)."""
        picks = batch.logits_indices
        if picks is None:
            return hidden
        if picks.size == 0:
            return hidden[:0]
        if picks.size == hidden.shape[0] and np.array_equal(picks, np.arange(picks.size)):
            return hidden
        return fo.gather(hidden, self.staging.put(picks))

    # ---- serving: packed rows over a paged cache -------------------------------------

    def forward(
        self, batch: PackedBatch, cache: PagedKVCache, num_layers: int | None = None
    ) -> ForwardOutput:
        """Target pass: writes K/V of every row, returns logits and final hidden states.
        ``num_layers``: only the first N decoder layers, then the final norm and the head
        (a draft made of the model's first layers; ``cache`` holds N layers)."""
        self.staging.reset()
        x = self._embed(batch.input_ids)
        layers = self._decoder_layers()[: num_layers or self.config.num_hidden_layers]
        x, delta = self._run_layers(layers, x, batch, cache)
        hidden, summed = self.model.norm.add_normalize(x, delta, weighted=True)
        logits = self.compute_logits(self._select(hidden, batch))
        return ForwardOutput(logits=logits, hidden=summed if self._mtp_reads_prenorm else hidden)

    def mtp_forward(
        self,
        batch: PackedBatch,
        prev_hidden: paddle.Tensor,
        cache: PagedKVCache,
        draft_vocab: bool = False,
    ) -> ForwardOutput:
        """MTP pass. Row r pairs ``prev_hidden[r]`` (state at position p) with
        ``batch.input_ids[r]`` (the token at p+1) and sits at MTP position p; its logits
        predict the token at p+2. The returned hidden states feed the next substep.
        ``draft_vocab``: logits over the draft vocabulary where one is set
        (``out.vocab_ids`` names their tokens)."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP layer (num_nextn_predict_layers=0)")
        self.staging.reset()
        x = self.mtp.fuse(self._embed(batch.input_ids), prev_hidden, True)
        x, delta = self._run_layers([self.mtp], x, batch, cache)
        # The layer's output and its norm in one op, for every row: a decode substep's
        # rows are all picked, and a catch-up's extra rows cost less normed than gathered.
        normed, x = self.mtp.shared_head.norm.add_normalize(x, delta, weighted=True)
        if self._mtp_norm_in_layer:
            # The norm ends the layer: its output, for every row, is the next input too.
            picked = self._select(normed, batch)
            logits, ids = self._mtp_logits(picked, draft_vocab)
            return ForwardOutput(logits, hidden=normed, picked_hidden=picked, vocab_ids=ids)
        logits, ids = self._mtp_logits(self._select(normed, batch), draft_vocab)
        return ForwardOutput(
            logits=logits, hidden=x, picked_hidden=self._select(x, batch), vocab_ids=ids
        )

    def _mtp_logits(
        self, hidden: paddle.Tensor, draft_vocab: bool
    ) -> tuple[paddle.Tensor, np.ndarray | None]:
        if draft_vocab:
            return self.compute_draft_logits(hidden)
        return self.compute_logits(hidden), None

    # ---- dense: [B, T] causal, no cache (training and the oracle) --------------------

    def forward_dense(
        self, input_ids: paddle.Tensor, past: list[KV] | None = None
    ) -> tuple[paddle.Tensor, paddle.Tensor, list[KV]]:
        """Causal pass over ``[B, T]`` tokens that follow ``past`` (contiguous per-layer K/V
        of the earlier positions, or None). Returns logits ``[B, T, V]``, the final hidden
        states ``[B, T, d]`` the MTP layer reads (normed, or before the norm where the MTP
        layout wants that) and the K/V of every position so far."""
        self.require_weights("forward_dense()")
        start = 0 if past is None else int(past[0][0].shape[1])
        t = input_ids.shape[1]
        cos, sin = self._rope(paddle.arange(start, start + t, dtype="int64"))
        mask = _dense_mask(t, start, self.dtype)
        x = self.model.embed_tokens(input_ids)
        presents: list[KV] = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer.forward_dense(x, cos, sin, mask, None if past is None else past[i])
            presents.append(kv)
        hidden = self.model.norm(x)
        return self.compute_logits(hidden), x if self._mtp_reads_prenorm else hidden, presents

    def mtp_forward_dense(
        self, next_ids: paddle.Tensor, prev_hidden: paddle.Tensor, past: KV | None = None
    ) -> tuple[paddle.Tensor, paddle.Tensor, KV]:
        """Dense MTP: ``next_ids[:, p]`` is the token at p+1 and ``prev_hidden[:, p]`` the
        state at p; returns (logits for p+2, MTP hidden for the next substep, MTP K/V so
        far)."""
        self.require_weights("mtp_forward_dense()")
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP layer (num_nextn_predict_layers=0)")
        start = 0 if past is None else int(past[0].shape[1])
        t = next_ids.shape[1]
        cos, sin = self._rope(paddle.arange(start, start + t, dtype="int64"))
        x = self.mtp.fuse(self.model.embed_tokens(next_ids), prev_hidden)
        x, kv = self.mtp.forward_dense(x, cos, sin, _dense_mask(t, start, self.dtype), past)
        normed = self.mtp.shared_head.norm(x)
        return self.compute_logits(normed), normed if self._mtp_norm_in_layer else x, kv


def _dense_mask(t: int, start: int, dtype: DType) -> paddle.Tensor:
    """Rows are positions ``start..start+t-1``; columns are positions ``0..start+t-1``."""
    return paddle.to_tensor(np.triu(np.full((t, start + t), -np.inf), k=start + 1).astype(dtype))


def build_model(
    cfg: ModelConfig, dtype: DType = "float32", seed: int | None = None, init: bool = True
) -> SpectrioForCausalLM:
    """A freshly initialised model (small-std normal init, as Llama uses). ``init=False``
    skips that draw for a model whose every weight is about to be loaded: the loader
    refuses a checkpoint that lacks one, so no drawn value survives a load."""
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
    if seed is not None:
        paddle.seed(seed)
    if init:
        model = SpectrioForCausalLM(cfg)
        normal = nn.initializer.Normal(0.0, 0.02)
        for _name, p in model.named_parameters():
            if p.ndim == 2:
                normal(p)
        if dtype != "float32":
            model.to(dtype=dtype)
    else:
        # Parameters without storage until the loader sets them: Paddle's default
        # initializers would draw every weight only for it to be overwritten. Created in
        # ``dtype`` directly, since a storage-less parameter cannot be cast.
        previous = paddle.get_default_dtype()
        paddle.set_default_dtype(dtype)
        try:
            with paddle.LazyGuard():
                model = SpectrioForCausalLM(cfg)
        finally:
            paddle.set_default_dtype(previous)
    model.eval()
    return model
