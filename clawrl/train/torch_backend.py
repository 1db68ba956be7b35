"""Plain-PyTorch training backend: one process, CPU or one GPU, full fine-tune or LoRA. The step
logic and every formula come from :class:`clawrl.train.base.TrainBackend` and ``clawrl/algo``."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from clawrl.checkpoint import MASTER_FILE, trainer_weights
from clawrl.train.base import GRAD_CLIP, LossFn, PPOHyperParams, TrainBackend, default_loss
from clawrl.train.batch import TokenBatch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TorchBackend(TrainBackend):
    """The :class:`~clawrl.train.base.TrainBackend` for plain PyTorch."""

    OPTIMIZER_STATE_FORMAT = "clawrl-torch-adamw-v1"

    def __init__(self, model_dir: Path, hp: PPOHyperParams, *, dtype: str = "float32", device: str = "cpu",
                 lora_rank: int = 0, lora_alpha: float = 32.0, deterministic: bool = True,
                 reference_dir: Path | None = None, loss_fn: LossFn = default_loss) -> None:
        """``model_dir``: the weights to train (the base model, or a checkpoint to resume from);
        ``reference_dir``: the frozen KL reference (default ``model_dir``; a resumed trainer
        passes the base model). The reference is kept only when ``hp.kl_coef > 0`` or LoRA is
        on; with LoRA and no separate ``reference_dir`` it is the model with adapters off."""
        from transformers import AutoModelForCausalLM

        super().__init__(hp, dtype=dtype, deterministic=deterministic, loss_fn=loss_fn)
        self.model_dir = Path(model_dir)
        same_ref = reference_dir is None or Path(reference_dir).resolve() == self.model_dir.resolve()
        self.device = torch.device(device)
        self.lora_rank = lora_rank
        model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
        if (master := trainer_weights(self.model_dir)) is not None:  # served in bf16: go on from float32
            missing, unexpected = model.load_state_dict(master, strict=False)
            if unexpected or set(missing) - {"lm_head.weight"}:  # a tied lm_head is the embedding
                raise ValueError(f"{self.model_dir / MASTER_FILE}: missing {missing[:3]}, unexpected {unexpected[:3]}")
        self.hf_config = model.config  # saved with checkpoints unchanged
        model.to(self.device).eval()
        self.reference = None
        if hp.kl_coef > 0 and not (lora_rank > 0 and same_ref):
            if same_ref:
                self.reference = copy.deepcopy(model)  # the weights this trainer starts from
            else:
                self.reference = AutoModelForCausalLM.from_pretrained(str(reference_dir), dtype=torch.float32)
                self.reference.to(self.device).eval()
            self.reference = self._frozen(self.reference)
        if lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            cfg = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0,
                             target_modules=list(LORA_TARGETS), bias="none")
            model = get_peft_model(model, cfg)  # adapters off = the weights loaded from model_dir
        self.model = model
        self._live: dict[str, Tensor] | None = None  # live_state_dict()
        self._init_optimizer()

    @contextmanager
    def _reference_model(self) -> Iterator[torch.nn.Module]:
        if self.reference is None and self.lora_rank > 0:
            with self.model.disable_adapter():
                yield self.model
        elif self.reference is None:
            raise ValueError("no reference model: it is kept only when kl_coef > 0 or LoRA is on")
        else:
            yield self.reference

    def _logprobs(self, model: torch.nn.Module, mb: TokenBatch, entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Only response tokens are trained, so the vocabulary projection (the largest tensor of
        the step) starts at the micro-batch's first response position, via HF's
        ``logits_to_keep``: for agent turns (long prompts, short outputs) it skips most of it.
        Earlier positions are 0."""
        start = int(mb.response_mask.argmax(-1).min())  # first 1.0 of the earliest-starting row
        # No attention_mask: batches are right-padded, so under the causal mask no real token
        # attends to padding, and the pure-causal attention path is the fastest one.
        with self._autocast():
            logits = model(input_ids=mb.input_ids, use_cache=False,
                           logits_to_keep=mb.input_ids.shape[1] - start).logits
        logits = logits[:, :-1].float()  # position t predicts input_ids[t+1]
        lse = torch.logsumexp(logits, dim=-1)  # (b, w)
        logprobs = logits.gather(-1, mb.input_ids[:, start + 1 :, None]).squeeze(-1) - lse  # log softmax
        if not entropy:
            return F.pad(logprobs, (start, 0)), None
        with torch.no_grad():
            h = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # H = logsumexp(z) - sum_v p_v z_v
        return F.pad(logprobs, (start, 0)), F.pad(h, (start, 0))

    def _clip_gradients(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, GRAD_CLIP))

    def _export_moments(self, moments: dict[str, Tensor], keep_device: bool = False) -> dict[str, Tensor]:
        if keep_device:
            return {n: t.detach().clone() for n, t in moments.items()}
        return {n: t.detach().to("cpu", copy=True) for n, t in moments.items()}

    def _import_moments(self, state: Mapping[str, Any]) -> dict[str, dict[str, Tensor]] | None:
        """With LoRA the adapters restart at zero on the merged weights, so old moments would
        describe other parameters: they are not loaded (a warning says so)."""
        if self.lora_rank > 0:
            warnings.warn("LoRA resume: adapters restart on the merged checkpoint; AdamW moments not restored",
                          stacklevel=3)
            return None
        names = set(self.param_names)
        missing, unexpected = sorted(names - set(state["exp_avg"])), sorted(set(state["exp_avg"]) - names)
        if missing or unexpected:
            raise ValueError(f"optimizer state does not match the model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        return {key: state[key] for key in ("exp_avg", "exp_avg_sq")}

    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, Tensor]:
        """Float32 copies (LoRA deltas merged in; the live model is untouched)."""
        if self.lora_rank == 0:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        from peft.tuners.lora import LoraLayer

        base = self.model.get_base_model()
        out = {k.replace(".base_layer.", "."): v.detach().clone() for k, v in base.state_dict().items()
               if "lora_" not in k}
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                for adapter in module.active_adapters:
                    out[f"{name}.weight"] += module.get_delta_weight(adapter)  # W + (alpha/r) B A
        return out

    def live_state_dict(self) -> dict[str, Tensor]:
        """Without LoRA the model's own tensors (cloning them cost ~9 ms of a ~12 ms sync of Qwen3-0.6B on an
        H200), found once: the optimizer updates them in place. A tied ``lm_head.weight`` is the embedding's
        very tensor object, so the engine's tie check needs no comparison of values."""
        if self.lora_rank:
            return self.hf_state_dict()
        if self._live is None:
            by_ptr: dict[int, Tensor] = {}
            self._live = {k: by_ptr.setdefault(v.data_ptr(), v.detach())
                          for k, v in self.model.state_dict(keep_vars=True).items()}
        return self._live

    def _weights_to_save(self, keep_device: bool = False) -> dict[str, Tensor]:  # on the device already
        # without LoRA the live tensors are saved as they are: cloning 0.5 GB first costs more than
        # the write (save_file only reads them)
        if self.lora_rank == 0:
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        return self.hf_state_dict()
