"""Settings that existed once and what took their place (clawrl/config.py names it when a config file or a
CLAWRL__ variable still sets one)."""

from __future__ import annotations

# Keys that existed once, and what took their place: a config file that still sets one is told what to do
# (a snapshot a replay reads drops them: it trains with what replaced them, and says if its bytes differ).
_FIXED_ADAMW = "fixed: AdamW with betas 0.9 and 0.98, no weight decay, gradients clipped at norm 1"
_FIXED_HINTS = "fixed: one hint vote, the longest usable hint, appended to the last user message"
REMOVED_KEYS = {
    ("engine", "kind"): "an [engine] url makes it an HTTP engine; without one it is the embedded engine",
    ("engine", "urls"): "put SGLang's router in front of the engines and name it in [engine] url (`clawrl up --engines "
                        "N` starts N engines and the router); each weight sync reaches every worker the router lists",
    ("engine", "sync_waves"): "the workers behind SGLang's router are updated one at a time while the others serve",
    ("engine", "down_retry_s"): "SGLang's router takes a worker that stops answering out and back (its circuit "
                                "breaker and health checks)",
    ("engine", "port"): "`clawrl engine` listens on [server] api_port + 10, or its --port",
    ("engine", "request_timeout_s"): "[engine] stall_timeout_s: a call fails when the engine sends nothing that long",
    ("engine", "chunked_prefill_size"): "fixed: 2048 tokens on the CPU, 8192 on CUDA",
    ("engine", "prefix_cache_tokens"): "fixed: the prefix cache keeps up to a quarter of [engine] max_total_tokens",
    ("engine", "max_queued_requests"): "fixed: beyond 1024 waiting requests the engine answers 503",
    ("engine", "cuda_graphs"): "fixed: on with CUDA",
    ("server", "served_model_name"): "fixed: clawrl-policy (clients may send any model name)",
    ("server", "side_turn_patterns"): "clawrl knows the maintenance calls of the agents it supports (OpenClaw's "
                                      "compaction summariser and memory flush); others send X-Turn-Type: side",
    ("server", "prompt_cache_key_boundary"): "fixed: a ':<digits>' suffix of prompt_cache_key is left out",
    ("server", "session_idle_timeout_s"): "fixed: a session idle for 15 minutes is closed",
    ("server", "max_sessions"): "fixed: 10,000 open sessions in memory",
    ("server", "max_n"): "fixed: at most 8 choices a request",
    ("server", "max_body_bytes"): "fixed: bodies over 4 MiB get 413",
    ("ppo", "clip_range"): "fixed: the ratio is clipped to [0.8, 1.28]",
    ("ppo", "clip_range_high"): "fixed: the ratio is clipped to [0.8, 1.28]",
    ("ppo", "reference_logprobs"): "the judge scores them when it holds the initial weights, else the trainer",
    ("ppo", "lr_schedule"): "[ppo] lr_decay_steps > 0 decays lr to lr_min on a cosine; 0 keeps it constant",
    ("ppo", "lr_warmup_steps"): "fixed: no warm-up",
    ("ppo", "weight_decay"): _FIXED_ADAMW, ("ppo", "adam_beta1"): _FIXED_ADAMW, ("ppo", "adam_beta2"): _FIXED_ADAMW,
    ("ppo", "grad_clip"): _FIXED_ADAMW,
    ("ppo", "ppo_epochs"): "fixed: one optimizer pass a batch",
    ("ppo", "kl_type"): "fixed: the k3 estimator",
    ("ppo", "entropy_coef"): "fixed: no entropy bonus",
    ("ppo", "loss_agg"): "fixed: the token mean",
    ("ppo", "dual_clip"): "fixed: no dual clip",
    ("ppo", "tis_cap"): "fixed: truncated importance sampling capped at 2",
    ("ppo", "w_rl"): "fixed at 1: [ppo] w_opd sets the balance of the two terms",
    ("ppo", "group_norm"): "[ppo] group_by = 'none', 'prompt' or 'batch'",
    ("ppo", "lora_alpha"): "fixed: 32",
    ("ppo", "deterministic"): "fixed: on (exact replay)",
    ("prm", "engine_urls"): "put SGLang's router in front of the judge engines and name it in [prm] engine_url "
                            "(`clawrl up --judge-engines N` starts them and the router)",
    ("prm", "url"): "[prm] backend = 'provider' with [provider] base_url at the SGLang server's /v1",
    ("prm", "engine_port"): "`clawrl up` starts the judge engine on [server] api_port + 21",
    ("prm", "temperature"): "fixed: judge votes are sampled at 0.6",
    ("prm", "budget_chars"): "fixed: the judge sees 6,000 characters of the turn and its context",
    ("prm", "max_in_flight"): "fixed: 16 turns judged at once",
    ("prm", "retries"): "fixed: a failed turn is judged again twice",
    ("prm", "retry_delay_s"): "fixed: 1 s, doubling",
    ("prm", "batch_limit"): "`clawrl judge --limit`; a judge run of `clawrl up` takes at most 4 x [ppo] "
                            "rollout_batch_size turns (at least 64)",
    ("opd", "hint_samples"): _FIXED_HINTS, ("opd", "hint_policy"): _FIXED_HINTS,
    ("opd", "hint_candidates"): _FIXED_HINTS, ("opd", "hint_placement"): _FIXED_HINTS,
    ("opd", "advantage_clip"): "fixed: top-k OPD clips its per-token term to [-1, 1]",
    ("storage", "mlflow_ui_url"): "set the environment variable CLAWRL_MLFLOW_UI_URL (`clawrl up` sets it)",
    ("gate", "replay_scorer"): "[gate] evaluator: with eval_set 'replay', fn(messages, answer) -> score",
    ("gate", "samples"): "fixed: two answers a prompt",
    ("gate", "max_tokens"): "[ppo] max_new_tokens, at most 64",
    ("gate", "temperature"): "[ppo] temperature, what users get",
    ("gate", "guard_tolerance"): "fixed: a guarded group may not drop",
    ("gate", "engine_port"): "`clawrl up` starts the evaluation engine on [server] api_port + 22",
    ("gate", "canary_port"): "`clawrl up` starts the canary engine on [server] api_port + 23",
    ("gate", "live_min_turns"): "fixed: 32 judged live turns a version",
    ("gate", "live_tolerance"): "fixed: a drop of 0.1",
}
