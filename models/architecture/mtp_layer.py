"""The DeepSeek-V3-style MTP draft layer: one decoder block over the fused pair of the next
token's embedding and the previous hidden state (:class:`MTPLayer`)."""

from __future__ import annotations

from spectrio.models.ops.paddle_setup import paddle  # first: imports Paddle

# isort: split
from paddle import nn

from spectrio.models.architecture.config import ModelConfig
from spectrio.models.architecture.layers import DecoderLayer, RMSNorm
from spectrio.models.ops import fast_ops as fo
from spectrio.models.ops.serving_matrix import ServingMatrix


class SharedHead(nn.Layer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """One transformer block fed ``eh_proj([enorm(emb(t+1)), hnorm(h_t)])``; predicts t+2.

    Its serving weights are float16 panels by default (``half_weights``, which
    :meth:`~spectrio.models.architecture.model.SpectrioForCausalLM.set_draft_precision`
    sets): a draft substep reads half the bytes, and only the drafts depend on them."""

    half_weights = True
    _eh_weight: ServingMatrix | None = None  # eh_proj as the serving pass multiplies it

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias_attr=False)
        self.shared_head = SharedHead(cfg)

    def fuse(
        self, embeds: paddle.Tensor, prev_hidden: paddle.Tensor, serving: bool = False
    ) -> paddle.Tensor:
        """``eh_proj`` of the normed pair; ``serving``: through the serving weights (the
        paged pass's), else the parameter (training and the dense oracle)."""
        # ``forward``, not ``Layer.__call__`` and its hooks: this runs every draft substep.
        both = paddle.concat([self.enorm.forward(embeds), self.hnorm.forward(prev_hidden)], -1)
        if not serving or paddle.is_grad_enabled():
            return fo.matmul(both, self.eh_proj.weight)  # eh_proj has no bias
        if self._eh_weight is None:
            self._eh_weight = ServingMatrix(self.eh_proj.weight.detach(), half=self.half_weights)
        return self._eh_weight.matmul(both)

    def drop_fused(self) -> None:
        super().drop_fused()
        self._eh_weight = None
