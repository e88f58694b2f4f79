"""The Qwen3 MoE family as one decoder: `qwen3_moe` and `qwen3_next` differ only in what the config selects.

qwen3_moe: attention layers, plain RMSNorm, routed experts. qwen3_next: Gated DeltaNet layers among gated
attention layers, (1 + w) RMSNorm, a shared expert, and an MTP head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from app.kernels.interface import Backends, Picks
from app.models.attention import Attention
from app.models.batch import ForwardBatch
from app.models.config import LINEAR_ATTENTION, ModelConfig
from app.models.gdn import GatedDeltaNet
from app.models.layers import DenseMLP, Linear, RMSNorm, RotaryEmbedding, linear
from app.models.moe import SparseMoE


def norm(config: ModelConfig, dim: int, backends: Backends) -> RMSNorm:
    """An RMSNorm of the model's kind (offset or not) with the backends' fused kernels."""
    return RMSNorm(dim, config.rms_norm_eps, config.offset_norm, backends.rms_norm, backends.add_rms_norm)


@dataclass(frozen=True)
class ModelPart:
    """What one stage of a layer split holds: the decoder layers `layers`; the first stage also the
    embedding, the LM head and the MTP head (it embeds the tokens and samples), the last the final norm."""

    layers: range
    first: bool
    last: bool


class Absent(nn.Module):
    """In place of a module that another stage of a layer split holds."""


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (attention or Gated DeltaNet), then MLP (dense or MoE)."""

    def __init__(self, config: ModelConfig, layer: int, mixer: str, moe: bool, backends: Backends) -> None:
        super().__init__()
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: Attention | None = None
        if mixer == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, layer, backends)
        else:
            self.self_attn = Attention(config, layer, backends)
        self.mlp: SparseMoE | DenseMLP
        if moe:
            self.mlp = SparseMoE(
                config, backends.experts, backends.route, backends.linear, backends.moe_block
            )
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, backends.linear)
        self.input_layernorm = norm(config, config.hidden_size, backends)
        self.post_attention_layernorm = norm(config, config.hidden_size, backends)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        pending: torch.Tensor | Picks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | Picks]:
        """The residual stream `x` plus `pending` (the last layer's output, added here inside the input norm's
        kernel) through this layer: returns the stream and this layer's output, for the next norm to add (a
        MoE block's `Picks` where its kernels leave them, summed by that norm)."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            h, x = self.input_layernorm.add_forward(pending, x)
        h = self.linear_attn(h, batch) if self.linear_attn is not None else self.self_attn(h, batch, cos_sin)
        h, x = self.post_attention_layernorm.add_forward(h, x)
        if isinstance(self.mlp, SparseMoE):
            layout = batch.layout
            if layout is None:
                return x, self.mlp(h, picks=True)
            return x, self.mlp(h, layout.live_rows, layout.row_slots, picks=True)
        return x, self.mlp(h)


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's `model.*`)."""

    def __init__(self, config: ModelConfig, backends: Backends) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, config.layer_types[i], config.moe_layers[i], backends)
            for i in range(config.num_hidden_layers)
        )
        self.norm = norm(config, config.hidden_size, backends)
        self.rotary = RotaryEmbedding(config.rope, config.rotary_dim)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        x, pending = self.run_layers(batch, range(len(self.layers)), x, None, keep_picks=True)
        return self.final_norm(x, pending)

    def run_layers(
        self,
        batch: ForwardBatch,
        layers: range,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        keep_picks: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | Picks | None]:
        """The residual stream `x` and the output `pending` of the layer before (None: no layer yet) through
        `layers`: the stream and the last one's output, as a stage of a layer split hands them on (summed,
        unless `keep_picks` leaves a MoE block's `Picks` for `final_norm`)."""
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)
        for i in layers:
            x, pending = self.layers[i](x, batch, cos_sin, pending)
        if isinstance(pending, Picks) and not keep_picks:
            pending = pending.total()
        return x, pending

    def final_norm(self, x: torch.Tensor, pending: torch.Tensor | Picks | None) -> torch.Tensor:
        """The final hidden states: the last layer's output added to the stream, normed."""
        return self.norm.add_forward(pending, x)[0] if pending is not None else self.norm(x)


class MTPHead(nn.Module):
    """Qwen3-Next's multi-token-prediction head (`mtp.*`): predicts the token after next.

    Row t combines the normed embedding of token t+1 with the normed final hidden state of the main model at
    t through `fc`, runs one of its own attention + MoE layers (draft step k uses layer k mod layers; their
    layer indices follow the main model's, so they keep their own keys and values in the sequence state), and
    the final norm; the shared LM head then scores token t+2.
    """

    def __init__(self, config: ModelConfig, layers: int, backends: Backends) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.pre_fc_norm_embedding = norm(config, hidden, backends)
        self.pre_fc_norm_hidden = norm(config, hidden, backends)
        self.fc = Linear(2 * hidden, hidden, kernel=backends.linear)
        first = config.num_hidden_layers
        self.layers = nn.ModuleList(
            DecoderLayer(config, first + i, "full_attention", config.num_experts > 0, backends)
            for i in range(layers)
        )
        self.norm = norm(config, hidden, backends)

    def forward(
        self,
        hidden: torch.Tensor,
        next_embeds: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        step: int = 0,
    ) -> torch.Tensor:
        """Hidden states [tokens, hidden] for the token after next, from the main model's `hidden` and the
        embeddings of each row's next token."""
        x = torch.cat((self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)), dim=-1)
        x, out = self.layers[step % len(self.layers)](self.fc(x), batch, cos_sin)
        return self.norm.add_forward(out, x)[0]


class CausalLM(nn.Module):
    """A decoder with its LM head; `forward` maps a flat batch to hidden states, `logits` to vocab scores."""

    def __init__(self, config: ModelConfig, mtp_layers: int = 0, *, backends: Backends) -> None:
        super().__init__()
        self.config = config
        self.backends = backends
        self.model = DecoderModel(config, backends)
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, kernel=backends.linear)
        self.mtp = MTPHead(config, mtp_layers, backends) if mtp_layers else None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of every row, updating the batch's sequence state."""
        return self.model(batch)

    def keep_part(self, part: ModelPart) -> None:
        """Hold only `part` of the model: what other stages hold becomes `Absent` (before loading)."""
        decoder = self.model
        for i in range(len(decoder.layers)):
            if i not in part.layers:
                decoder.layers[i] = Absent()
        if not part.first:
            decoder.embed_tokens = Absent()  # type: ignore[assignment]
            self.lm_head = None
            self.mtp = None
        if not part.last:
            decoder.norm = Absent()  # type: ignore[assignment]

    def mtp_forward(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch, step: int = 0
    ) -> torch.Tensor:
        """The MTP head's hidden states for the batch's rows: `hidden` is `forward`'s output for them and
        `next_ids` [tokens] the token after each row; `logits` of the result score the token after that.

        The head's layers keep keys and values under their own layer indices, so the batch's state must hold
        them (a `SequenceState` such as the tests' contiguous one; the engine's paged pool does not yet).
        """
        if self.mtp is None:
            raise ValueError("this model has no MTP head")
        cos_sin = self.model.rotary.cos_sin(batch.positions, hidden.dtype)
        return self.mtp(hidden, self.model.embed_tokens(next_ids), batch, cos_sin, step)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits [rows, vocab] in fp32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight, None, self.backends.linear).float()
