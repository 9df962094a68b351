"""
Every setting of a training run, in one place: its default and what it means. train.py and
tools/bench.py take them, tools/make_config.py writes them into a commented config, `python train.py
--help` lists them, and docs/settings.md's table shows them. A config file (config/*.py) is plain
assignments of these names; --key=value on the command line overrides any of them (configurator.py).

Each setting also says what resuming a run (init_from='resume') does with it, one rule for all of
them:
    refuse    the architecture: the checkpoint's weights mean nothing under another value, so a
              different value stops the run, naming the setting and both values
    allow     a deliberate change that is safe: the run's length and schedule, the layout,
              logging, the hardware, the context length and rope_theta (for a context
              extension); the change is printed
    inherit   everything else (the data, the batch, the optimizer): the checkpoint's value, unless
              the command line or a config file gives another, which is printed
Whatever the kind, a setting left out takes the checkpoint's value, not the default here (resuming
without the config file continues the same run); a key that an older checkpoint lacks takes its
default. out_dir and init_from are how this launch finds the checkpoint, never taken from it.
"""

import itertools
import math

from configurator import ConfigError, Setting, section
from context_parallel import check_context_split
from fp8 import RECIPES as FP8_RECIPES
from model import config_problems, mlp_hidden_size
from optim import TP_MODES as MUON_TP_MODES
from parallel import expert_groups, grid_rank, resolve_dp

TRAINING = [
    *section(
        "I/O",
        Setting("out_dir", "out", "checkpoints and metrics.jsonl go here", resume="allow"),
        Setting(
            "data_dir", "data/fineweb_edu", "train.bin, val.bin and meta.json from prepare_data.py"
        ),
        Setting(
            "init_from",
            "scratch",
            "'scratch', 'resume' (from the newest complete checkpoint in out_dir), 'auto' (resume "
            "when out_dir holds one, else scratch: for torchrun --max-restarts) or a transformers "
            "model folder (config.json and safetensors weights; the model settings come from it)",
            resume="allow",
        ),
        Setting(
            "seed",
            1337,
            "fixes the initial weights and the data order (a pure function of seed and step)",
        ),
        Setting(
            "log_interval",
            10,
            "steps between log lines (each one reads the loss back: a host-device sync)",
            resume="allow",
        ),
        Setting(
            "eval_interval",
            100,
            "steps between evaluations of train/val loss (0 = never)",
            resume="allow",
        ),
        Setting(
            "eval_iters",
            20,
            "global batches per evaluation (the same fixed ones every time, so train and val "
            "loss do not depend on the layout)",
            resume="allow",
        ),
        Setting(
            "checkpoint_interval",
            100,
            "steps between checkpoints, plus one at the end (0 = never)",
            resume="allow",
        ),
        Setting(
            "keep_last_n", 3, "complete checkpoints kept in out_dir (0 keeps all)", resume="allow"
        ),
    ),
    *section(
        "faults: what a run does when a step, a peer or the job's time goes wrong",
        Setting(
            "max_bad_steps",
            3,
            "steps in a row whose gradient norm is not finite (each one skipped) before "
            "the run stops",
            resume="allow",
        ),
        Setting(
            "dist_timeout_s",
            600.0,
            "seconds a rank waits in a collective for its peers before it stops with "
            "a message (the longest skew between ranks: a first compile, a save, an evaluation)",
            resume="allow",
        ),
    ),
    *section(
        "logging: metrics.jsonl always; these optional backends get the same records",
        Setting(
            "wandb_log",
            False,
            "Weights & Biases (pip install wandb; WANDB_MODE=offline works without a network)",
            resume="allow",
        ),
        Setting("wandb_project", "picotron", "W&B project", resume="allow"),
        Setting("wandb_run_name", "picotron", "W&B run name", resume="allow"),
        Setting(
            "tensorboard_log",
            False,
            "event files in <out_dir>/tensorboard (pip install tensorboard)",
            resume="allow",
        ),
    ),
    *section(
        "hardware and how the model runs on it",
        Setting(
            "device",
            "auto",
            "'auto' (CUDA when present), 'cpu', 'cuda', 'cuda:1', ...",
            resume="allow",
        ),
        Setting(
            "dtype",
            "auto",
            "'auto' (bf16 on Ampere+, fp16 before, fp32 on CPU), 'float32', 'bfloat16', 'float16', "
            "or 'float64' (CPU only: everything in float64, to tell rounding from a real "
            "difference, scripts/compare.py)",
            resume="allow",
        ),
        Setting("attn_impl", "auto", "'auto', 'sdpa', 'flash', 'eager'", resume="allow"),
        Setting(
            "compile",
            False,
            "torch.compile the model (falls back to eager, with a log line, where compiling fails)",
            resume="allow",
        ),
        Setting(
            "fp8",
            "none",
            "'tensorwise' or 'rowwise': the linears but the head and router "
            "compute in FP8 (fp8.py, torchao's recipes; weights and checkpoints "
            "unchanged); 'none': the run's dtype",
            resume="allow",
        ),
        Setting(
            "activation_checkpointing",
            False,
            "recompute each block's activations in backward: less memory, ~1/3 more compute",
            resume="allow",
        ),
        Setting(
            "chunked_loss",
            True,
            "tp=1: the loss a chunk of tokens at a time, never the whole (tokens, vocab) logits",
            resume="allow",
        ),
        Setting(
            "peak_flops",
            0.0,
            "the device's peak FLOP/s for MFU; 0 = from the GPU table, or measured on CPU",
            resume="allow",
        ),
    ),
    *section(
        "model",
        Setting("n_layer", 4, "transformer blocks", resume="refuse"),
        Setting("n_head", 4, "query heads", resume="refuse"),
        Setting(
            "n_kv_head",
            4,
            "key/value heads: n_head is MHA, fewer is GQA, 1 is MQA",
            resume="refuse",
        ),
        Setting("n_embd", 128, "model width", resume="refuse"),
        Setting("block_size", 256, "context length in tokens", resume="allow"),
        Setting(
            "vocab_size", None, "from the data's meta.json unless set", type=int, resume="refuse"
        ),
        Setting(
            "tie_embeddings",
            True,
            "the output head shares the token embedding matrix",
            resume="refuse",
        ),
        Setting("rope_theta", 10000.0, "RoPE base frequency", resume="allow"),
        Setting("norm_eps", 1e-5, "epsilon of the norms", resume="refuse"),
        Setting(
            "head_dim",
            0,
            "attention head size; 0 = n_embd / n_head (Qwen3: 128 in any width)",
            resume="refuse",
        ),
        Setting(
            "intermediate_size",
            0,
            "the MLP's hidden width; 0 = ~8/3 n_embd (SwiGLU) or 4 n_embd (GELU)",
            resume="refuse",
        ),
        Setting(
            "rope_scaling_factor",
            0.0,
            "Llama 3.1's RoPE scaling: low frequencies slowed by this factor "
            "(Llama 3.2: 32); 0 = plain RoPE",
            resume="allow",
        ),
        Setting(
            "rope_low_freq_factor",
            1.0,
            "RoPE scaling: wavelengths over rope_original_context / this are scaled",
            resume="allow",
        ),
        Setting(
            "rope_high_freq_factor",
            4.0,
            "RoPE scaling: wavelengths under rope_original_context / this are kept",
            resume="allow",
        ),
        Setting(
            "rope_original_context",
            8192,
            "RoPE scaling: the context the model was pretrained at before scaling",
            resume="allow",
        ),
    ),
    *section(
        "model variants (model.py explains each, with its paper)",
        Setting(
            "attention",
            "mha",
            "'mha' (n_kv_head < n_head makes it GQA, 1 MQA) or 'mla' (DeepSeek-V2 latent "
            "attention)",
            resume="refuse",
        ),
        Setting(
            "kv_lora_rank",
            64,
            "mla: width of the compressed key/value latent that a KV cache would store",
            resume="refuse",
        ),
        Setting(
            "q_lora_rank",
            0,
            "mla: width of the compressed query latent; 0 = full-rank queries",
            resume="refuse",
        ),
        Setting(
            "qk_rope_head_dim",
            16,
            "mla: query/key dims per head that carry RoPE (the key part is shared by all heads)",
            resume="refuse",
        ),
        Setting(
            "qk_nope_head_dim",
            32,
            "mla: query/key dims per head without positions",
            resume="refuse",
        ),
        Setting("v_head_dim", 32, "mla: value dims per head", resume="refuse"),
        Setting(
            "qk_norm", False, "RMSNorm on each query and key head before RoPE", resume="refuse"
        ),
        Setting(
            "attn_softcap",
            0.0,
            "cap * tanh(score / cap) on attention scores (Gemma 2: 50); 0 = off; not on SDPA",
            resume="refuse",
        ),
        Setting(
            "final_softcap",
            0.0,
            "the same on the output logits (Gemma 2: 30); 0 = off",
            resume="refuse",
        ),
        Setting(
            "parallel_block",
            False,
            "x + attn(norm(x)) + mlp(norm(x)) (GPT-J, PaLM) instead of one after the other",
            resume="refuse",
        ),
        Setting("norm", "rmsnorm", "'rmsnorm' or 'layernorm'", resume="refuse"),
        Setting(
            "mlp",
            "swiglu",
            "'swiglu' (hidden ~8/3 n_embd) or 'gelu' (hidden 4 n_embd, GPT-2)",
            resume="refuse",
        ),
        Setting(
            "bias",
            False,
            "biases in the attention and MLP linears and in LayerNorm",
            resume="refuse",
        ),
        Setting(
            "n_expert",
            0,
            "Mixture-of-Experts: routed experts per MLP layer; 0 = dense MLP",
            resume="refuse",
        ),
        Setting("n_expert_per_token", 2, "top-k: experts each token is sent to", resume="refuse"),
        Setting(
            "capacity_factor",
            1.25,
            "an expert takes at most ceil(capacity_factor * tokens * k / n_expert) "
            "tokens; 0 = dropless (every token reaches its experts)",
        ),
        Setting(
            "aux_loss_coef",
            0.01,
            "weight of each MoE layer's load-balancing loss (Switch Transformer)",
        ),
        Setting(
            "n_shared_expert",
            0,
            "experts every token also goes through (DeepSeekMoE)",
            resume="refuse",
        ),
        Setting(
            "router_z_loss_coef", 0.0, "weight of the router z-loss (ST-MoE used 1e-3); 0 = off"
        ),
        Setting(
            "qkv_bias",
            False,
            "biases in the query, key and value projections only (Qwen2)",
            resume="refuse",
        ),
        Setting(
            "doc_mask",
            False,
            "attention stops at each end-of-text token and positions restart after it "
            "(model.py: document masking)",
            resume="allow",
        ),
        Setting(
            "eot_token",
            None,
            "the end-of-text id that ends each document, from the data's meta.json unless set",
            type=int,
        ),
    ),
    *section(
        "batch: one step sees batch_size * gradient_accumulation_steps * dp "
        "windows of block_size tokens",
        Setting("batch_size", 8, "micro-batch per data-parallel rank"),
        Setting(
            "gradient_accumulation_steps",
            1,
            "micro-batches per step (the pipeline's microbatches when pp > 1)",
        ),
    ),
    *section(
        "the optimizer and the learning-rate schedule: linear warmup, then a decay to min_lr "
        "(cosine, or held and decayed late: wsd)",
        Setting(
            "max_iters",
            1000,
            "optimizer steps in the run (0 with init_from=<a model folder>: convert it and exit)",
            resume="allow",
        ),
        Setting("learning_rate", 1e-3, "peak learning rate, reached after warmup", resume="allow"),
        Setting("min_lr", 1e-4, "learning rate at the end of the decay", resume="allow"),
        Setting("warmup_iters", 50, "steps of linear warmup", resume="allow"),
        Setting(
            "lr_decay_iters",
            1000,
            "step where the decay reaches min_lr (usually max_iters)",
            resume="allow",
        ),
        Setting(
            "weight_decay",
            0.1,
            "decoupled weight decay (AdamW's, and Muon's), on matrices only (not norms, biases)",
        ),
        Setting("beta1", 0.9, "AdamW beta1"),
        Setting("beta2", 0.95, "AdamW beta2"),
        Setting("grad_clip", 1.0, "clip the global gradient norm to this (0 disables)"),
        Setting(
            "lr_schedule",
            "cosine",
            "'cosine' or 'wsd' (warmup, the peak held, then decay_frac of lr_decay_iters decaying)",
            resume="allow",
        ),
        Setting(
            "decay_frac",
            0.2,
            "wsd: the last fraction of lr_decay_iters that decays to min_lr",
            resume="allow",
        ),
        Setting(
            "decay_shape",
            "1-sqrt",
            "wsd: the decay's shape, 'linear' or '1-sqrt' (lr falls as the square "
            "root of the decay's progress)",
            resume="allow",
        ),
        Setting(
            "optimizer",
            "adamw",
            "'adamw', or 'muon': Muon for the blocks' matrices, AdamW for the rest (optim.py)",
        ),
    ),
    *section(
        "Muon (optimizer='muon'): orthogonalised momentum, its update scaled to "
        "AdamW's RMS (same learning_rate)",
        Setting("muon_momentum", 0.95, "Muon's Nesterov momentum coefficient"),
        Setting("muon_ns_steps", 5, "Newton-Schulz iterations that orthogonalise the momentum"),
        Setting(
            "muon_tp_mode",
            "auto",
            "under tp: 'replicate' every tp rank orthogonalises every matrix, 'split' each "
            "matrix's owner alone (gathered, then scattered back), 'auto' whichever is faster "
            "per matrix at the device's rates (optim.split_pays)",
            resume="allow",
        ),
    ),
    *section(
        "parallelism: dp * cp * tp * pp processes",
        Setting(
            "dp",
            0,
            "data-parallel ranks; 0 means world_size / (cp * tp * pp), and a resumed run's dp "
            "follows its world size unless given",
            resume="allow",
        ),
        Setting("tp", 1, "tensor-parallel ranks", resume="allow"),
        Setting("pp", 1, "pipeline stages", resume="allow"),
        Setting(
            "pp_schedule",
            "1f1b",
            "'1f1b', 'afab', 'interleaved_1f1b', 'zero_bubble' (ZB-H1) or 'zbv' (python "
            "tools/timeline.py draws each)",
            resume="allow",
        ),
        Setting(
            "zero_stage",
            0,
            "1 shards the optimizer states across data-parallel ranks, 2 also the "
            "gradients, 3 also the parameters",
            resume="allow",
        ),
        Setting(
            "bucket_size_mb",
            25.0,
            "data-parallel gradients are averaged in buckets of about this size",
            resume="allow",
        ),
        Setting(
            "overlap_param_gather",
            True,
            "ZeRO-1/2: each bucket's all-gather after the step is waited for "
            "where the next forward first reads it (False: at once)",
            resume="allow",
        ),
        Setting(
            "cp",
            1,
            "context-parallel ranks: each holds 2 of the 2*cp zigzag chunks of every sequence, "
            "attention is ring attention",
            resume="allow",
        ),
        Setting(
            "sequence_parallel",
            False,
            "with tp > 1: the tokens between the tensor-parallel regions split "
            "across tp (Megatron)",
            resume="allow",
        ),
        Setting(
            "pp_chunks",
            1,
            "model chunks per pipeline rank (virtual stages): interleaved_1f1b any, zbv 2, the "
            "others 1",
            resume="allow",
        ),
        Setting(
            "pp_layers",
            "",
            "the blocks of each model stage, first to last, pp * pp_chunks numbers "
            "summing to n_layer ('7,1'); '' cuts the stages by their FLOPs, the head and "
            "loss counted (build.stage_cut)",
            resume="allow",
        ),
        Setting(
            "pp_trace",
            False,
            "time every pipeline action of the second step on every rank: <out_dir>/"
            "pp_trace.json (Chrome trace), the measured bubble printed",
            resume="allow",
        ),
        Setting(
            "comm_ledger",
            False,
            "print the first step's communication ledger: each mechanism's calls, bytes sent "
            "and milliseconds waited, per op (ledger.py)",
            resume="allow",
        ),
        Setting(
            "ep",
            1,
            "expert-parallel ranks: each MoE layer's experts are spread over ep neighbouring "
            "data-parallel ranks (ep divides dp and n_expert)",
            resume="allow",
        ),
    ),
]

DEFAULTS = {s.name: s.default for s in TRAINING}

# sizes and intervals that must be positive (or at least zero): a zero batch or a negative interval
# would otherwise fail far from its cause, or silently do nothing (the model's own rules, such as
# heads dividing the width or the MoE settings, are model.config_problems': check_layout, below,
# says them with the layout's)
POSITIVE = (
    "batch_size",
    "block_size",
    "gradient_accumulation_steps",
    "log_interval",
    "eval_iters",
    "n_layer",
    "n_head",
    "n_kv_head",
    "n_embd",
    "rope_theta",
    "tp",
    "pp",
    "learning_rate",
    "bucket_size_mb",
    "cp",
    "pp_chunks",
    "ep",
    "muon_ns_steps",
    "max_bad_steps",
    "dist_timeout_s",
)
NOT_NEGATIVE = (
    "seed",
    "eval_interval",
    "checkpoint_interval",
    "keep_last_n",
    "warmup_iters",
    "lr_decay_iters",
    "min_lr",
    "norm_eps",
    "dp",
    "weight_decay",
    "grad_clip",
    "peak_flops",
    "zero_stage",
    "max_iters",
    "head_dim",
    "intermediate_size",
    "rope_scaling_factor",
)

# settings that take one of a few words
CHOICES = {
    "lr_schedule": ("cosine", "wsd"),
    "decay_shape": ("linear", "1-sqrt"),
    "optimizer": ("adamw", "muon"),
    "muon_tp_mode": MUON_TP_MODES,
    "fp8": FP8_RECIPES,
}


def optimizer_problems(values):
    """The rules of the optimizer and learning-rate schedule settings (Muon's included) that no
    type can say, in check_values' words."""
    problems = []
    if not 0 <= values["decay_frac"] <= 1:
        problems.append(
            f"decay_frac = {values['decay_frac']} must be between 0 and 1 (the share "
            "of lr_decay_iters that decays)"
        )
    if not 0 <= values["muon_momentum"] < 1:
        problems.append(f"muon_momentum = {values['muon_momentum']} must be at least 0 and below 1")
    if values["min_lr"] > values["learning_rate"]:
        problems.append(
            f"min_lr = {values['min_lr']} is above learning_rate = {values['learning_rate']}: the "
            "decay would raise the learning rate; set min_lr at most learning_rate (a tenth of it "
            f"is usual: --min_lr={values['learning_rate'] / 10:g})"
        )
    if values["max_iters"] == 0 and values["init_from"] in ("scratch", "resume", "auto"):
        problems.append(
            "max_iters = 0 trains nothing: it only converts a model, with init_from=<a "
            f"transformers model folder> (init_from is {values['init_from']!r})"
        )
    problems += [
        f"{k} = {values[k]} must be in [0, 1) (AdamW's moments average "
        f"over about 1 / (1 - {k}) steps)"
        for k in ("beta1", "beta2")
        if not 0 <= values[k] < 1
    ]
    return problems


def pp_layers_problems(values):
    """pp_layers, when set: pp * pp_chunks whole numbers summing to n_layer."""
    if not values["pp_layers"]:
        return []
    n_stages, n_layer = values["pp"] * values["pp_chunks"], values["n_layer"]
    parts = values["pp_layers"].split(",")
    whole = all(p.strip().isdigit() and int(p) > 0 for p in parts)
    if whole and len(parts) == n_stages and sum(map(int, parts)) == n_layer:
        return []
    even = [n_layer // n_stages + (s < n_layer % n_stages) for s in range(n_stages)]
    # (fewer blocks than stages: no cut can do, and check_layout says so whatever pp_layers is)
    return [
        f"pp_layers = {values['pp_layers']!r} must be pp * pp_chunks = {n_stages} whole "
        f"numbers, each at least 1, summing to n_layer = {n_layer}: the blocks of each "
        "model stage, first to last ("
        + (
            f"for example {','.join(map(str, even))!r}; '' cuts the stages by their cost)"
            if min(even) > 0
            else f"n_layer = {n_layer} blocks cannot fill {n_stages} stages: lower --pp or "
            f"--pp_chunks)"
        )
    ]


def zero_stage_problems(values):
    """zero_stage is 0 to 3, with either optimizer (under ZeRO Muon deals its matrices whole:
    optim.py)."""
    problems = []
    if values["zero_stage"] not in (0, 1, 2, 3):
        problems.append(
            f"zero_stage must be 0 (plain AdamW), 1 (optimizer states sharded across data-parallel "
            f"ranks), 2 (and the gradients) or 3 (and the parameters), got {values['zero_stage']}"
        )
    return problems


def check_values(values):
    """The value rules no type can say: every number finite, sizes and intervals in range, one of
    the allowed words, the optimizer's and schedule's settings consistent (optimizer_problems), a
    non-empty out_dir, the pipeline cut and the ZeRO stage. Raises ConfigError naming every
    problem; returns the warnings to print (a setting that runs, but not as meant)."""
    # a NaN passes every comparison below (nan <= 0 is False) and would fail far off, in a traceback
    problems = [
        f"{k} = {v} must be a finite number"
        for k, v in values.items()
        if isinstance(v, float) and not math.isfinite(v)
    ]
    if problems:
        raise ConfigError("; ".join(problems))
    problems = [f"{k} = {values[k]} must be positive" for k in POSITIVE if values[k] <= 0]
    problems += [f"{k} = {values[k]} must not be negative" for k in NOT_NEGATIVE if values[k] < 0]
    problems += [
        f"{k} = {values[k]!r} must be one of {', '.join(map(repr, allowed))}"
        for k, allowed in CHOICES.items()
        if values[k] not in allowed
    ]
    problems += optimizer_problems(values)
    if values["vocab_size"] is not None and values["vocab_size"] <= 0:
        problems.append(
            f"vocab_size = {values['vocab_size']} must be positive (or None: from meta.json)"
        )
    if not values["out_dir"].strip():
        problems.append("out_dir is empty: name the folder the run writes to")
    problems += pp_layers_problems(values) + zero_stage_problems(values)
    if problems:
        raise ConfigError("; ".join(problems))
    return schedule_warnings(values)


def schedule_warnings(values):
    """A learning-rate schedule that runs but not as a schedule: warmup reaching lr_decay_iters
    climbs to the peak and then falls to min_lr in one step (get_lr: past lr_decay_iters it is
    min_lr)."""
    warmup, decay = values["warmup_iters"], values["lr_decay_iters"]
    if 0 < warmup < values["max_iters"] and warmup >= decay:
        return [
            f"warning: warmup_iters = {warmup} is not below lr_decay_iters = {decay}: the learning "
            f"rate climbs for {warmup} steps, then drops to min_lr = {values['min_lr']} in one "
            "step, with no decay (lower --warmup_iters, or decay over the run: "
            f"--lr_decay_iters={values['max_iters']})"
        ]
    return []


def resume_values(values, given, saved, source=None):
    """The settings of a resumed run: `values` as configured now, `given` the names the user set,
    `saved` the settings in the checkpoint. Returns (values, notes to print); raises ConfigError
    naming every refused change. The same rules take a transformers model's settings
    (init_from=<folder>): `saved` is then its architecture, read from `source`, its config.json."""
    values, notes, refused = dict(values), [], []
    for s in TRAINING:
        if s.name in ("out_dir", "init_from") or s.name not in saved:
            continue
        old = saved[s.name]
        if s.name not in given:
            values[s.name] = old
        elif values[s.name] != old:
            new = values[s.name]
            if s.resume == "refuse":
                refused.append(
                    f"{s.name} = {new!r} (the {'model' if source else 'checkpoint'} has {old!r})"
                )
            else:
                notes.append(
                    f"{'init_from' if source else 'resume'}: {s.name} = {new!r}, the "
                    f"{'model' if source else 'checkpoint'}'s was {old!r}"
                    + (" (the run's recipe changes)" if s.resume == "inherit" else "")
                )
    if refused and source:
        raise ConfigError(
            f"the settings given describe another model than {source}: "
            + "; ".join(refused)
            + ". Leave these settings out: a model's architecture comes from its config.json"
        )
    if refused:
        raise ConfigError(
            "the checkpoint was trained with another architecture: "
            + "; ".join(refused)
            + ". Leave these settings out to resume it as it is, or start a new run with "
            "--init_from=scratch and another --out_dir"
        )
    return values, notes


# -----------------------------------------------------------------------------
# resuming at another world size: the layout and the global batch

BATCH = ("batch_size", "gradient_accumulation_steps")


def batch_recipe(meta):
    """The batch a run was first given, {batch_size, gradient_accumulation_steps, windows} (windows:
    the global batch, batch_size x gradient_accumulation_steps x dp), as its checkpoints record it;
    a checkpoint written before they did has its own settings and layout."""
    if "recipe" in meta:
        return meta["recipe"]
    c = {**DEFAULTS, **meta["config"]}
    return {
        "batch_size": c["batch_size"],
        "gradient_accumulation_steps": c["gradient_accumulation_steps"],
        "windows": c["batch_size"] * c["gradient_accumulation_steps"] * meta["layout"]["dp"],
    }


def resume_settings(values, given, meta, path, world_size):
    """The settings of a run resumed from the checkpoint at `path` (its `meta`) by this launch of
    world_size processes: resume_values' rules, and then:
      the layout  dp follows the world size (every elastic restart changes it) unless given
                  again; an inherited ep that does not divide the new dp is lowered to one that
                  does (the experts reshard between ep values); inherited cp, tp or pp that do not
                  fit the world stop the run, saying they came from the checkpoint and which flags
                  to pass;
      the batch   init_from='auto' (a restart, maybe on fewer or more nodes) keeps the run's
                  recipe, the global batch it was first given (batch_recipe), when the batch
                  settings it is given are the recipe's (a config file or scripts/slurm.sh passes
                  the same ones every time), changing gradient_accumulation_steps or batch_size for
                  the new dp (keep_global_batch); given other values, or init_from='resume' (a
                  deliberate choice: the values as given or inherited), the batch is what they make
                  it. "The run's recipe changes" is said only when the global batch does.
    Returns (values, notes to print)."""
    # a model converted from transformers: no run to continue yet
    if "batch_size" not in meta["config"]:
        values, notes = resume_values(values, given, meta["config"])
        return values, notes + follow_the_world(values, given, world_size, path)
    auto = values["init_from"] == "auto"
    recipe = batch_recipe(meta)
    # a restart compares the batch settings it is given with the recipe's, not the last launch's
    # adjusted ones: the same values given every time keep one global batch over any restarts
    before = {k: recipe[k] if auto else meta["config"][k] for k in BATCH}
    values, notes = resume_values(
        values, given, {k: v for k, v in meta["config"].items() if k not in BATCH}
    )
    values.update({k: before[k] for k in BATCH if k not in given})
    notes += follow_the_world(values, given, world_size, path)
    dp = resolve_dp(
        world_size, values["dp"], values["tp"], values["pp"], cp=values["cp"], ep=values["ep"]
    )
    keeping = auto and all(values[k] == recipe[k] for k in BATCH)
    if keeping:
        notes += keep_global_batch(values, recipe["windows"], dp)  # (says so when it changes them)
    saved = meta["config"]
    windows = values["batch_size"] * values["gradient_accumulation_steps"] * dp
    changed = [k for k in BATCH if values[k] != saved[k]]
    if windows != saved["batch_size"] * saved["gradient_accumulation_steps"] * meta["layout"]["dp"]:
        notes += [
            f"resume: {k} = {values[k]!r}, the checkpoint's was "
            f"{saved[k]!r} (the run's recipe changes)"
            for k in changed
        ]
    elif changed and not keeping:
        notes.append(
            f"resume: batch_size {values['batch_size']} x gradient_accumulation_steps "
            f"{values['gradient_accumulation_steps']} x dp {dp} keep the checkpoint's "
            f"global batch of {windows} windows"
        )
    return values, notes


def follow_the_world(values, given, world_size, path):
    """A resumed run's layout at this launch's world size (see resume_settings); returns the
    notes."""
    notes = []
    if "dp" not in given:
        values["dp"] = 0  # whatever the world leaves after cp * tp * pp
    inherited = [k for k in ("cp", "tp", "pp") if k not in given and values[k] > 1]
    split = values["cp"] * values["tp"] * values["pp"]
    procs = f"{world_size} process{'es' if world_size != 1 else ''}"
    if inherited and (world_size % split or values["dp"] not in (0, world_size // split)):
        cut = (f"dp = {values['dp']} x " if values["dp"] else "") + " x ".join(
            f"{k} = {values[k]}" for k in ("cp", "tp", "pp")
        )
        raise ConfigError(
            f"WORLD_SIZE = {procs} cannot be cut into {cut}: "
            + ", ".join(f"{k} = {values[k]}" for k in inherited)
            + f" came from the checkpoint "
            f"{path} (a setting left out is the checkpoint's). Pass the layout for {procs}, for "
            f"example "
            + " ".join(f"--{k}={v}" for k, v in layout_that_fits(values, inherited, world_size))
        )
    dp = world_size // split if world_size % split == 0 else 0
    ep = values["ep"]
    if "ep" not in given and ep > 1 and dp and dp % ep:
        values["ep"] = math.gcd(ep, dp)  # divides ep, so n_expert too, and dp
        notes.append(
            f"resume: ep = {values['ep']}, the checkpoint's was {ep}, which does not divide dp = "
            f"{dp} at {procs} (the experts reshard between ep values; pass --ep to choose)"
        )
    return notes


def layout_that_fits(values, inherited, world_size):
    """The settings to pass, [(name, value)], for a layout of world_size processes close to
    `values`: the axes given on the command line kept as far as the world allows, then each
    inherited one (cp, tp, pp) lowered to its largest divisor that fits what is left (a divisor of
    tp or cp splits the model wherever they did); a given dp takes the rest. At pp = 1, the settings
    that need a pipeline go back to one stage (pipeline_schedules.check_schedule), and a cut the
    stage count changes to the cut by cost; at tp = 1, sequence parallelism goes off (check_layout).
    """
    axes = [k for k in ("dp", "cp", "tp", "pp") if k not in inherited and values[k] > 0] + inherited
    fit, left = {}, world_size
    for k in axes:
        fit[k] = math.gcd(values[k], left)
        left //= fit[k]
    if "dp" in fit:
        fit["dp"] *= left  # (a given dp: the processes no other axis takes)
    flags = [
        (k, fit[k])
        for k in ("dp", "cp", "tp", "pp")
        if k in fit and (k in inherited or fit[k] != values[k])
    ]
    if fit["pp"] == 1 and values["pp_schedule"] == "zbv":
        flags.append(("pp_schedule", "1f1b"))
    if fit["pp"] == 1 and values["pp_chunks"] > 1:
        flags.append(("pp_chunks", 1))
    if values["pp_layers"] and fit["pp"] != values["pp"]:
        flags.append(("pp_layers", "''"))
    # sequence parallelism splits tokens across tp ranks: at tp = 1 there are none to split
    if fit["tp"] == 1 and values["sequence_parallel"]:
        flags.append(("sequence_parallel", False))
    return flags


def keep_global_batch(values, windows, dp):
    """batch_size and gradient_accumulation_steps in `values` changed for data-parallel size dp so
    that batch_size * gradient_accumulation_steps * dp is the run's global batch of `windows`:
    another batch is another recipe. gradient_accumulation_steps changes first (batch_size is what
    fits in memory, and an MoE's capacity is per micro-batch), then batch_size, then both (one
    micro-batch). Returns the notes to print; raises ConfigError when no integer pair keeps the
    batch."""
    bs, gas = values["batch_size"], values["gradient_accumulation_steps"]
    if bs * gas * dp == windows:
        return []
    if windows % (bs * dp) == 0:
        values["gradient_accumulation_steps"] = windows // (bs * dp)
    elif windows % (gas * dp) == 0:
        values["batch_size"] = windows // (gas * dp)
    elif windows % dp == 0:  # one micro-batch of all of this rank's windows
        values["batch_size"], values["gradient_accumulation_steps"] = windows // dp, 1
    else:
        raise ConfigError(
            f"the run's global batch is {windows} windows (batch_size x "
            f"gradient_accumulation_steps x dp), which dp = {dp} cannot keep: {windows} windows do "
            f"not split evenly across {dp} replicas. Launch a number of processes whose dp divides "
            f"{windows}, or give --batch_size and --gradient_accumulation_steps for a new global "
            "batch, or resume with --init_from=resume (the batch settings as given or as the "
            "checkpoint has them, the global batch whatever they make it)"
        )
    return [
        f"resume: dp = {dp}: batch_size {values['batch_size']} x gradient_accumulation_steps "
        f"{values['gradient_accumulation_steps']} keep the run's global batch of {windows} windows"
    ]


def global_batch(values, dp):
    """The step's global batch, batch_size x gradient_accumulation_steps x dp windows of block_size
    tokens: every layout given the same one trains the same model as one process
    (docs/equivalence.md), and a layout with more dp ranks trains a larger one unless batch_size or
    the accumulation is divided by dp."""
    bs, gas, block = (
        values["batch_size"],
        values["gradient_accumulation_steps"],
        values["block_size"],
    )
    return (
        f"global batch {bs} x {gas} micro-batches x dp {dp} = {bs * gas * dp} x {block} = "
        f"{bs * gas * dp * block:,} tokens"
    )


def global_batch_change(saved, tokens_per_step):
    """The line saying that a resumed run's step sees another number of tokens than the checkpoint's
    run did (batch_size is per data-parallel rank: inherited at another dp, or with another
    accumulation or context length), or None. saved: the checkpoint's meta."""
    c, dp = {**DEFAULTS, **saved["config"]}, saved["layout"]["dp"]  # (an older one may lack a key)
    before = c["batch_size"] * c["gradient_accumulation_steps"] * dp * c["block_size"]
    if before == tokens_per_step:
        return None
    return (
        f"resume: the global batch is now {tokens_per_step:,} tokens per step, the checkpoint's "
        f"run had {c['batch_size']} x {c['gradient_accumulation_steps']} micro-batches x dp {dp} x "
        f"{c['block_size']} = {before:,} (set batch_size or gradient_accumulation_steps to keep it)"
    )


def check_layout(cfg, tp=1, pp=1, cp=1, sequence_parallel=False, chunks=1, ep=1):
    """Stop before anything is built when the model cannot be built from cfg
    (model.config_problems), or cannot be split this way (chunks: model chunks per pipeline rank),
    saying what must hold and what to change."""
    problems = config_problems(cfg) + layout_problems(
        cfg, tp, pp, cp, sequence_parallel, chunks, ep
    )
    if problems:
        raise ValueError("the model cannot be built with this layout: " + "; ".join(problems))


def layout_problems(cfg, tp, pp, cp, sequence_parallel, chunks, ep):
    """check_layout's sentences about the layout: what each mechanism needs of the model's
    shapes."""
    problems = []
    if sequence_parallel and tp == 1:
        problems.append(
            "sequence_parallel=True needs tp > 1: it splits the tokens between the tensor-parallel "
            "regions across the tp ranks; set --tp to 2 or more, or sequence_parallel=False"
        )
    if sequence_parallel and tp > 1:
        problems += sequence_split_problems(cfg.block_size, cp, tp)
    else:
        try:  # context parallelism's 2*cp chunks
            check_context_split(cfg.block_size, cp)
        except ValueError as e:
            problems.append(str(e))
    if tp > cfg.n_head:
        problems.append(
            f"tp = {tp} is larger than n_head = {cfg.n_head}: each rank needs at least one whole "
            "head, so use a tp that divides n_head"
        )
    elif cfg.n_head % tp:
        problems.append(
            f"n_head = {cfg.n_head} must be divisible by tp = {tp} (each rank takes n_head / tp "
            "whole heads): use a tp that divides n_head"
        )
    if cfg.attention == "mha" and cfg.n_kv_head % tp and tp % cfg.n_kv_head:
        problems.append(
            f"n_kv_head = {cfg.n_kv_head} and tp = {tp}: one must divide the other (key/value "
            "heads are split when tp divides n_kv_head, replicated when n_kv_head divides tp)"
        )
    if mlp_hidden_size(cfg) % tp:
        source = "intermediate_size" if cfg.intermediate_size else f"from n_embd = {cfg.n_embd}"
        problems.append(
            f"the MLP width {mlp_hidden_size(cfg)} ({source}) must be divisible by tp = {tp}"
        )
    if cfg.n_expert > 0 and cfg.n_expert % ep:
        problems.append(
            f"n_expert = {cfg.n_expert} must be divisible by ep = {ep} (each expert-parallel rank "
            "holds n_expert / ep whole experts): use an ep that divides n_expert"
        )
    elif cfg.n_expert <= 0 and ep > 1:
        problems.append(
            f"ep = {ep} spreads the experts of a mixture of experts over ranks, but n_expert = 0 "
            "(a dense model): set n_expert > 0 or ep = 1"
        )
    if pp * chunks > cfg.n_layer:
        if chunks == 1:
            problems.append(
                f"pp = {pp} stages but only n_layer = {cfg.n_layer} blocks: every stage needs at "
                f"least one block, so use pp <= {cfg.n_layer}"
            )
        else:
            problems.append(
                f"pp = {pp} ranks x pp_chunks = {chunks} chunks = {pp * chunks} model stages but "
                f"only n_layer = {cfg.n_layer} blocks: every chunk needs at least one block, so "
                f"use pp * pp_chunks <= {cfg.n_layer}"
            )
    return problems


def sequence_split_problems(seq_len, cp, tp):
    """What sequence parallelism needs of the length: tp equal pieces, and under context parallelism
    each cp rank's tokens split again across tp, so 2*cp*tp equal chunks. A list of sentences (none:
    it splits)."""
    pieces = (2 * cp if cp > 1 else 1) * tp
    if seq_len % pieces == 0:
        return []
    lower, upper = seq_len // pieces * pieces, (seq_len // pieces + 1) * pieces
    fix = f"Set block_size to a multiple of {pieces} (e.g. {lower or upper} or {upper})"
    if cp == 1:
        return [
            f"block_size = {seq_len} does not split into tp = {tp} equal pieces: sequence "
            "parallelism gives each tensor-parallel rank 1/tp of the tokens between the "
            f"tensor-parallel regions. {fix}, or change tp"
        ]
    return [
        f"block_size = {seq_len} does not split into 2 * cp * tp = {pieces} (cp = {cp}, tp = "
        f"{tp}: sequence parallelism splits each rank's tokens again across tp) equal "
        "chunks: context parallelism gives each rank chunk r and chunk 2*cp-1-r of every "
        f"window. {fix}, or change cp"
    ]


# -----------------------------------------------------------------------------
# The layout in words: its start-up lines, rank grid and tp groups across nodes
# (parallel.ParallelLayout's)


def tp_groups_across_nodes(dp, tp, pp, local_world_size, cp=1):
    """The tensor-parallel groups (lists of global ranks) that are not all on one node, when every
    node runs local_world_size processes with consecutive ranks, as torchrun numbers them
    (LOCAL_WORLD_SIZE). A tp group is tp consecutive ranks (tp fastest), so none spans two nodes
    when tp divides local_world_size; otherwise its all-reduces, several per layer, cross the
    network between nodes."""
    spanning = []
    for p, d, c in itertools.product(range(pp), range(dp), range(cp)):
        ranks = [grid_rank(p, d, t, dp, tp, c, cp) for t in range(tp)]
        if len({r // local_world_size for r in ranks}) > 1:
            spanning.append(ranks)
    return spanning


def format_grid(dp, tp, pp, cp=1, ep=1, n_expert=0):
    """The rank layout as text, one line per (pipeline stage, data-parallel replica), and under
    context parallelism per share of the sequence too: which global ranks hold the tensor-parallel
    slices of it; under expert parallelism which experts each replica holds, followed by the expert
    groups."""
    lines = []
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                ranks = [grid_rank(p, d, t, dp, tp, c, cp) for t in range(tp)]
                share = f" sequence share {c} (chunks {c}, {2 * cp - 1 - c})" if cp > 1 else ""
                held = ""
                if ep > 1:
                    first, n = (d % ep) * (n_expert // ep), n_expert // ep
                    held = f", experts {first}-{first + n - 1}" if n > 1 else f", expert {first}"
                lines.append(f"  stage {p} replica {d}{share}: ranks {ranks}{held}")
    if ep > 1:
        blocks, replicas = expert_groups(dp, tp, pp, cp, ep)
        lines.append(
            f"  expert-parallel groups (ep={ep}, tokens sent to their experts all-to-all): "
            + " ".join(map(str, blocks))
        )
        lines.append(
            "  expert replicas (the same experts, gradients averaged): "
            + (
                " ".join(map(str, replicas))
                if dp * cp > ep
                else "none, every expert is on one rank"
            )
        )
    return "\n".join(lines)


def describe_layout(layout, sequence_parallel=False, n_expert=0, per_node=None):
    """The start-up lines naming the layout, its rank grid, and a warning when a tensor-parallel
    group spans two nodes (per_node: the processes per node, torchrun's LOCAL_WORLD_SIZE)."""
    cut = f"dp={layout.dp} x cp={layout.cp}" if layout.cp > 1 else f"dp={layout.dp}"
    sp = " (sequence parallel)" if sequence_parallel else ""
    text = (
        f"layout: {cut} x tp={layout.tp}{sp} x pp={layout.pp} = {layout.world_size} processes"
        + (f", experts over ep={layout.ep} of the dp ranks" if layout.ep > 1 else "")
        + "\n"
        + format_grid(layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, n_expert)
    )
    per_node = per_node or layout.world_size
    spanning = tp_groups_across_nodes(layout.dp, layout.tp, layout.pp, per_node, layout.cp)
    return text + (
        f"\nwarning: {len(spanning)} tensor-parallel group(s) span two nodes (ranks "
        f"{spanning[0]} with {per_node} process{'es' if per_node != 1 else ''} per node): their "
        f"all-reduces, several per layer, cross the network. Make tp = {layout.tp} divide "
        f"--nproc_per_node = {per_node}"
        if spanning
        else ""
    )
