"""The Hugging Face wrapper appended to the generated ``modeling_loom.py`` (tools/hf_export.py).

This file is a template, not used on its own: the import from torchtitan_loom below is stripped
when it is stitched after the model's own source, where those names are defined.

Legend: B batch rows, S sequence length, V vocab.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from torchtitan_loom.models.loom.args import LoomModelArgs
from torchtitan_loom.models.loom.model import LoomTransformer


class LoomConfig(PretrainedConfig):
    """``loom_args``: every LoomModelArgs field as trained; ``loops``: loops run (default all)."""

    model_type = "loom"

    def __init__(self, loom_args: dict | None = None, loops: int | None = None, **kwargs):
        self.loom_args = dict(loom_args or {})
        self.loops = loops
        kwargs.setdefault(
            "use_cache", False
        )  # every step recomputes the prefix (no HF cache object)
        super().__init__(**kwargs)


class LoomForCausalLM(PreTrainedModel, GenerationMixin):
    """LoomTransformer (capacity dropping off, sdpa attention) behind the causal-LM interface.

    A 0 in ``attention_mask`` marks padding: padded positions get doc id -1 (the model's padding
    convention), so real tokens never attend to them, and positions count real tokens only (left
    padding works).
    """

    config_class = LoomConfig
    base_model_prefix = "model"
    _no_split_modules = ["LoomBlock"]

    def __init__(self, config: LoomConfig):
        super().__init__(config)
        known = {f.name for f in dataclasses.fields(LoomModelArgs)}
        args = LoomModelArgs(**{k: v for k, v in config.loom_args.items() if k in known})
        self.model = LoomTransformer(args.replace(capacity_factor=0, attn_backend="sdpa"))
        self.post_init()

    def _init_weights(self, module):
        """Weights always come from model.safetensors; nothing to initialise here."""

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def get_output_embeddings(self):
        return self.model.output

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        real_BS = attention_mask.to(torch.long)
        positions_BS = (real_BS.cumsum(dim=1) - 1).clamp_min(0)
        out = self.model(input_ids, positions_BS, real_BS - 1, loop_end=self.config.loops)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                out.logits_BSV[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=out.logits_BSV)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}
