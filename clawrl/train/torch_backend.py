"""Plain-PyTorch training backend: one process, CPU or one GPU, full fine-tune or LoRA.

The backend owns the model, the optimizer and the frozen reference; the step logic and every
formula come from :func:`clawrl.train.base.run_ppo_step` and ``clawrl/algo``. It lives as long as
the trainer does: weights and AdamW state stay in memory between steps.

Precision: weights, gradients and AdamW state are float32; ``dtype="bfloat16"``/``"float16"``
runs the forward under autocast. Pure bf16 weights would drop updates smaller than ~1/256 of a
weight, i.e. every update at lr 1e-5.

The model runs in eval mode (dropout off) while it is trained: the old log-probs are read from the
first training forward, which must equal a no-grad forward at the same weights.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from clawrl.models import torch_dtype
from clawrl.train.base import LossFn, PPOHyperParams, default_loss, run_ppo_step, set_optimizer_lr
from clawrl.train.batch import TokenBatch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NOT_COPIED = {"config.json", ".complete"}  # written fresh, or a cache marker
OPTIMIZER_STATE_FORMAT = "clawrl-torch-adamw-v1"


class TorchBackend:
    """The :class:`~clawrl.train.base.TrainBackend` for plain PyTorch."""

    def __init__(self, model_dir: Path, hp: PPOHyperParams, *, dtype: str = "float32", device: str = "cpu",
                 lora_rank: int = 0, lora_alpha: float = 32.0, deterministic: bool = True,
                 reference_dir: Path | None = None, loss_fn: LossFn = default_loss) -> None:
        """``model_dir``: the weights to train (the base model, or a checkpoint to resume from);
        ``reference_dir``: the frozen KL reference (default ``model_dir``; a resumed trainer
        passes the base model). The reference is kept only when ``hp.kl_coef > 0`` or LoRA is
        on; with LoRA and no separate ``reference_dir`` it is the model with adapters off."""
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        ref_dir = self.model_dir if reference_dir is None else Path(reference_dir)
        self.hp = hp
        self.loss_fn = loss_fn  # [hooks] loss, or the default advantage + PPO loss
        self.device = torch.device(device)
        self.compute_dtype = torch_dtype(dtype)
        self.lora_rank = lora_rank
        if deterministic:
            # process-wide switches: a trainer process replays bit-exactly or fails loudly
            torch.manual_seed(hp.seed)
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
        self.hf_config = model.config  # saved with checkpoints unchanged
        model.to(self.device).eval()
        self.reference = None
        if hp.kl_coef > 0 and not (lora_rank > 0 and ref_dir.resolve() == self.model_dir.resolve()):
            if ref_dir.resolve() == self.model_dir.resolve():
                self.reference = copy.deepcopy(model)  # the weights this trainer starts from
            else:
                self.reference = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32)
                self.reference.to(self.device).eval()
            self.reference.requires_grad_(False)
        if lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            cfg = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0,
                             target_modules=list(LORA_TARGETS), bias="none")
            model = get_peft_model(model, cfg)  # adapters off = the weights loaded from model_dir
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.optimizer = torch.optim.AdamW(self.params, lr=hp.lr, betas=hp.betas, weight_decay=hp.weight_decay,
                                           fused=self.device.type == "cuda")
        self.lr = hp.lr  # set_lr: the trainer's schedule
        self.steps_done = 0

    # -- forwards ---------------------------------------------------------------------------

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _window_logits(self, model, mb: TokenBatch) -> tuple[Tensor, int]:
        """Logits for the target positions start .. l-2, where ``start`` is the micro-batch's first
        response position: (b, l-1-start, V) float32, and ``start``.

        Only response tokens are trained, so the vocabulary projection (the largest tensor of the
        step) skips the shared prompt prefix via HF's ``logits_to_keep``; for agent turns (long
        prompts, short outputs) most of it."""
        start = int(mb.response_mask.argmax(-1).min())  # first 1.0 of the earliest-starting row
        length = mb.input_ids.shape[1]
        # No attention_mask: batches are right-padded, so under the causal mask no real token
        # attends to padding, and the pure-causal attention path is the fastest one.
        with self._autocast():
            logits = model(input_ids=mb.input_ids, use_cache=False, logits_to_keep=length - start).logits
        return logits[:, :-1].float(), start  # position t predicts input_ids[t+1]

    def _forward(self, mb: TokenBatch, entropy_grad: bool) -> tuple[Tensor, Tensor]:
        """(logprobs, entropy) of a micro-batch, each (b, l-1), 0 before the first response
        position; logprobs carry grad."""
        logits, start = self._window_logits(self.model, mb)
        lse = torch.logsumexp(logits, dim=-1)  # (b, w)
        targets = mb.input_ids[:, start + 1 :, None]
        logprobs = logits.gather(-1, targets).squeeze(-1) - lse  # log softmax at the target
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            src = logits if entropy_grad else logits.detach()
            entropy = lse - (torch.softmax(src, dim=-1) * src).sum(-1)  # H = logsumexp(z) - sum_v p_v z_v
        if not entropy_grad:
            entropy = entropy.detach()
        return F.pad(logprobs, (start, 0)), F.pad(entropy, (start, 0))

    @torch.no_grad()
    def compute_logprobs(self, batch: TokenBatch, *, reference: bool = False) -> Tensor:
        """Log-prob of each next token from the first response position of each micro-batch on,
        (B, L-1) float32, 0 elsewhere and on padding; no grad."""
        batch = batch.to(self.device)
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=self.device)
        ctx = nullcontext()
        model = self.model
        if reference:
            if self.reference is not None:
                model = self.reference
            elif self.lora_rank > 0:
                ctx = self.model.disable_adapter()
            else:
                raise ValueError("no reference model: it is kept only when kl_coef > 0 or LoRA is on")
        with ctx:
            for s in range(0, len(batch), self.hp.micro_batch_size):
                mb = batch.slice(s, min(s + self.hp.micro_batch_size, len(batch)))
                logits, start = self._window_logits(model, mb)
                targets = mb.input_ids[:, start + 1 :, None]
                lp = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, -1)
                lp = lp * mb.attention_mask[:, start + 1 :]  # 0 on padding targets
                out[s : s + len(mb), start : start + lp.shape[1]] = lp
        return out

    # -- training ---------------------------------------------------------------------------

    def _optimizer_step(self) -> float:
        max_norm = self.hp.grad_clip if self.hp.grad_clip > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)  # weights stay as they were
            raise FloatingPointError(f"non-finite gradient norm {norm} at step {self.steps_done}; update skipped")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def set_lr(self, lr: float) -> None:
        self.lr = set_optimizer_lr(self.optimizer, lr)

    def train_step(self, batch: TokenBatch) -> dict[str, float]:
        batch = batch.to(self.device)
        ref = self.compute_logprobs(batch, reference=True) if self.hp.kl_coef > 0 else None
        metrics = run_ppo_step(batch, self.hp, forward=self._forward, optimizer_step=self._optimizer_step,
                               ref_logprobs=ref, loss_fn=self.loss_fn)
        self.steps_done += 1
        metrics["lr"] = self.lr
        return metrics

    # -- optimizer state (resume) ---------------------------------------------------------------

    def optimizer_state_dict(self) -> dict[str, Any]:
        """AdamW's moments by parameter name, on CPU:
        {"format", "step", "exp_avg": {name: tensor}, "exp_avg_sq": {name: tensor}}."""
        state = self.optimizer.state_dict()["state"]  # param index -> {"step", "exp_avg", "exp_avg_sq"}
        out: dict[str, Any] = {"format": OPTIMIZER_STATE_FORMAT, "step": 0, "exp_avg": {}, "exp_avg_sq": {}}
        if not state:
            return out
        steps = {float(s["step"]) for s in state.values()}
        if len(steps) != 1 or len(state) != len(self.params):
            raise RuntimeError(f"AdamW state covers {len(state)} of {len(self.params)} parameters "
                               f"at steps {sorted(steps)}")
        out["step"] = int(steps.pop())
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = {n: state[i][key].detach().cpu().clone() for i, n in enumerate(self.param_names)}
        return out

    def load_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`optimizer_state_dict` returned; lr, betas and weight decay stay this
        backend's own. With LoRA the adapters restart at zero on the merged weights, so old
        moments would describe other parameters: they are not loaded (a warning says so)."""
        if state.get("format") != OPTIMIZER_STATE_FORMAT:
            raise ValueError(f"optimizer state format {state.get('format')!r}; expected {OPTIMIZER_STATE_FORMAT!r}")
        if not state["exp_avg"]:
            return
        if self.lora_rank > 0:
            warnings.warn("LoRA resume: adapters restart on the merged checkpoint; AdamW moments not restored",
                          stacklevel=2)
            return
        names = set(self.param_names)
        missing, unexpected = sorted(names - set(state["exp_avg"])), sorted(set(state["exp_avg"]) - names)
        if missing or unexpected:
            raise ValueError(f"optimizer state does not match the model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        per_param = {i: {"step": torch.tensor(float(state["step"])),
                         "exp_avg": state["exp_avg"][n].clone(), "exp_avg_sq": state["exp_avg_sq"][n].clone()}
                     for i, n in enumerate(self.param_names)}  # moved to each parameter's device on load
        self.optimizer.load_state_dict({"state": per_param,
                                        "param_groups": self.optimizer.state_dict()["param_groups"]})

    # -- weights out ------------------------------------------------------------------------

    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, Tensor]:
        """Full weights under HF names, float32 copies (LoRA deltas merged in; the live model is
        untouched). A tied ``lm_head.weight`` is included, like HF's own state_dict."""
        if self.lora_rank == 0:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        from peft.tuners.lora import LoraLayer

        base = self.model.get_base_model()
        out: dict[str, Tensor] = {}
        for key, value in base.state_dict().items():
            if "lora_" in key:
                continue
            out[key.replace(".base_layer.", ".")] = value.detach().clone()
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                for adapter in module.active_adapters:
                    out[f"{name}.weight"] += module.get_delta_weight(adapter)  # W + (alpha/r) B A
        return out

    def save_checkpoint(self, out_dir: Path) -> Path:
        """config.json + model.safetensors + the source's tokenizer/generation files, written to
        a temp dir beside ``out_dir`` and renamed into place; an existing ``out_dir`` raises."""
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        if out_dir.exists():
            raise FileExistsError(f"checkpoint {out_dir} already exists; checkpoints are never overwritten")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is read by other processes
            # without LoRA the live tensors are saved as they are: cloning 0.5 GB first costs more
            # than the write (save_file only reads them)
            state = ({k: v.detach() for k, v in self.model.state_dict().items()} if self.lora_rank == 0
                     else self.hf_state_dict())
            if getattr(self.hf_config, "tie_word_embeddings", False):
                state.pop("lm_head.weight", None)  # safetensors refuses shared tensors; HF re-ties
            save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            self.hf_config.save_pretrained(str(tmp))
            for src in sorted(self.model_dir.iterdir()):
                if src.is_file() and src.name not in _NOT_COPIED and not src.name.startswith("model"):
                    shutil.copy2(src, tmp / src.name)
            os.replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out_dir
