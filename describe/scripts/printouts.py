#!/usr/bin/env python3
"""Generate the printout fixtures of tests/fixtures/summaries/printouts.jsonl.gz.

Model printouts as people paste them into gpucast (`torchsummary`, `torchinfo`, plain
`print(model)`, the GPUMemNet-style `print(model)` annotated with parameter counts, keras'
`model.summary()`), of a zoo of well-known models and of the 100 timm models of the
held-out test split (`data/timm/test.jsonl.gz`). Every model is built from its code or
config, no weights are downloaded (torchvision `weights=None`, timm `pretrained=False`,
transformers `Model(Config(...))`, keras applications `weights=None`), and run on the CPU at
batch 1-2. To save time, torch models skip the random init of their parameters (see
SkipParamInit; parameters are zero-filled); no printout depends on the weights' values.

    .venv-describe/bin/python describe/scripts/printouts.py [--only SUBSTRING ...]

writes `tests/fixtures/summaries/printouts.jsonl.gz` (one JSON object per line, sorted by
set, model, tool, notes; gzip with mtime 0, so identical rows give identical bytes) and
`tests/fixtures/summaries/PRINTOUTS.md` (provenance, counts, every failure and skip).
With `--only`, only models whose name contains one of the substrings are run and the
outputs go to `--out-dir` (default: a temporary directory), never over the committed files.

Needs torch, torchvision, timm, transformers, torchinfo, torchsummary and keras 3 (run with
the torch backend; KERAS_BACKEND is set here before keras is imported).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import gzip
import io
import json
import os
import platform
import random
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ["KERAS_BACKEND"] = "torch"
# rich (keras' summary renderer) sizes its console from COLUMNS when stdout is no terminal;
# fix it so the table is drawn the same way everywhere.
os.environ["COLUMNS"] = "200"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "summaries"
TEST_SPLIT = REPO / "data" / "timm" / "test.jsonl.gz"

MAX_TEXT_BYTES = 1 << 20  # the service's limit on a pasted summary
TOOL_TIMEOUT_S = 90  # one tool on one model (build excluded); longer is recorded as skipped
BUILD_TIMEOUT_S = 120
SEQ_LEN = 128
KERAS_LINE_LENGTH = 100
SEED = 0

TOOLS_VISION = ["torchsummary", "torchinfo", "torchinfo:depth=10", "print", "print_counts", "print_counts_dataparallel"]
TOOLS_TEXT = ["torchsummary", "torchinfo", "torchinfo:depth=10", "print", "print_counts", "print_counts_dataparallel"]
TOOLS_TIMM_TEST = ["torchsummary", "torchinfo", "print"]


class ToolTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise ToolTimeout()


@contextlib.contextmanager
def time_limit(seconds: int):
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# in-place value writers (tensor methods and torch.nn.init functions); metadata calls such
# as requires_grad_ are not among them and still run
_INIT_OPS = frozenset(
    """
    uniform_ normal_ trunc_normal_ erfinv_ exponential_ log_normal_ cauchy_ geometric_ random_
    bernoulli_ fill_ zero_ copy_ mul_ add_ sub_ div_ clamp_ clamp_min_ clamp_max_ sqrt_ abs_
    neg_ exp_ log_ fmod_ remainder_ masked_fill_ index_fill_ scatter_ index_copy_ t_
    constant_ ones_ zeros_ eye_ dirac_ xavier_uniform_ xavier_normal_ kaiming_uniform_
    kaiming_normal_ orthogonal_ sparse_ trunc_normal_tf_ variance_scaling_ lecun_normal_
""".split()
)


class SkipParamInit(TorchFunctionMode):
    """While building a torch model: in-place value writes on an nn.Parameter (the
    initialisers' uniform_, normal_, erfinv_, ...) are skipped, so no time goes into random
    init of weights that no printout shows (convnext_xxlarge builds in 0.1 s instead of
    30 s). Buffers are computed as usual; parameters are zero-filled after the build."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _INIT_OPS:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, nn.Parameter):
                return target
        return func(*args, **kwargs)


def seed_all(seed: int = SEED) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------
# print_counts: print(model) annotated as GPUMemNet's test pipeline writes module prints
# --------------------------------------------------------------------------------------


def _addindent(s_: str, num_spaces: int) -> str:
    """torch.nn.modules.module._addindent of torch 2.x."""
    s = s_.split("\n")
    if len(s) == 1:
        return s_
    first = s.pop(0)
    s = [(num_spaces * " ") + line if line.strip() else "" for line in s]
    return first + "\n" + "\n".join(s)


class _Counter:
    def __init__(self):
        # classes with children and their own __repr__: their insides stay unannotated
        self.custom_repr = set()

    def module_params(self, module: nn.Module) -> int:
        # module.parameters() yields every distinct tensor once: a tensor shared by two
        # submodules (GPT-2's wte/lm_head) counts once here, and in each submodule's line.
        return sum(p.numel() for p in module.parameters())

    def body(self, module: nn.Module) -> str:
        rep = type(module).__repr__
        if rep is nn.ModuleList.__repr__:
            return self._module_list(module)
        if rep is nn.Module.__repr__:
            return self._module(module)
        if module._modules:  # a leaf with its own repr is annotated like any leaf
            self.custom_repr.add(type(module).__name__)
        return repr(module)

    def annotated(self, module: nn.Module) -> str:
        return f"{self.body(module)}, {self.module_params(module):,} params"

    def _module(self, module: nn.Module) -> str:
        # nn.Module.__repr__ of torch 2.x, with each child's text annotated
        extra_lines = []
        extra_repr = module.extra_repr()
        if extra_repr:
            extra_lines = extra_repr.split("\n")
        child_lines = []
        for key, child in module._modules.items():
            if child is None:
                continue
            mod_str = _addindent(self.annotated(child), 2)
            child_lines.append("(" + key + "): " + mod_str)
        lines = extra_lines + child_lines
        main_str = module._get_name() + "("
        if lines:
            if len(extra_lines) == 1 and not child_lines:
                main_str += extra_lines[0]
            else:
                main_str += "\n  " + "\n  ".join(lines) + "\n"
        return main_str + ")"

    def _module_list(self, module: nn.Module) -> str:
        # nn.ModuleList.__repr__ of torch 2.x: consecutive identical children collapse into
        # "(a-b): n x <child>"; identity is decided on the annotated text, so only children
        # with the same repr and the same parameter count collapse
        reprs = [self.annotated(item) for item in module]
        if not reprs:
            return module._get_name() + "()"
        spans = [[0, 0]]
        blocks = [reprs[0]]
        for i, r in enumerate(reprs[1:], 1):
            if r == blocks[-1]:
                spans[-1][1] += 1
                continue
            spans.append([i, i])
            blocks.append(r)
        lines = []
        for (start, end), b in zip(spans, blocks):
            local = f"({start}): {b}"
            if start != end:
                local = f"({start}-{end}): {end - start + 1} x {b}"
            lines.append(_addindent(local, 2))
        return module._get_name() + "(\n  " + "\n  ".join(lines) + "\n)"


def footer_counts(model: nn.Module) -> tuple:
    """(total, trainable): every module's own direct parameters, summed over all modules.

    A tensor held by two modules (tied weights) is counted once per holder, so with tied
    weights the total exceeds the distinct count, as GPUMemNet's footers do."""
    total = trainable = 0
    for _, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            total += p.numel()
            if p.requires_grad:
                trainable += p.numel()
    return total, trainable


def print_counts_text(model: nn.Module) -> tuple:
    counter = _Counter()
    body = counter.annotated(model)
    total, trainable = footer_counts(model)
    text = (
        body
        + "\n"
        + "=" * 41
        + "\n"
        + f"Total params: {total:,}\n"
        + f"Trainable params: {trainable:,}\n"
        + f"Non-trainable params: {total - trainable:,}\n"
    )
    note = ""
    if counter.custom_repr:
        note = "own __repr__ printed unannotated inside: " + ", ".join(sorted(counter.custom_repr))
    return text, note


# --------------------------------------------------------------------------------------
# tools
# --------------------------------------------------------------------------------------


def captured(fn) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn()
    return buf.getvalue()


def run_tool(tool: str, model, spec: dict) -> tuple:
    """(text, notes) of one tool on one model."""
    name, _, opt = tool.partition(":")
    notes = []
    if name == "print":
        return captured(lambda: print(model)), ""
    if name == "print_counts":
        text, note = print_counts_text(model)
        return captured(lambda: print(text, end="")), note
    if name == "print_counts_dataparallel":
        dp = nn.DataParallel(model)  # CPU-only: keeps the module, device_ids=[]
        text, note = print_counts_text(dp)
        return captured(lambda: print(text, end="")), note
    if name == "torchsummary":
        import torchsummary

        if spec["input_shape"] is not None:
            size = tuple(spec["input_shape"])
        else:
            size = (spec["seq_len"],)
            notes.append(f"float input (2, {spec['seq_len']})")
        with torch.no_grad():
            text = captured(lambda: torchsummary.summary(model, size, device="cpu"))
        return text, "; ".join(notes)
    if name == "torchinfo":
        import torchinfo

        kwargs = {"verbose": 0, "device": "cpu"}
        if opt:
            key, _, val = opt.partition("=")
            kwargs[key] = int(val)
            notes.append(opt)
        if spec.get("input_data") is not None:
            kwargs["input_data"] = spec["input_data"]()
        else:
            kwargs["input_size"] = (1, *spec["input_shape"])
        stats = torchinfo.summary(model, **kwargs)
        return captured(lambda: print(stats)), "; ".join(notes)
    raise ValueError(tool)


def first_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    msg = msg[0] if msg else ""
    if len(msg) > 240:
        msg = msg[:237] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


# --------------------------------------------------------------------------------------
# model specs
# --------------------------------------------------------------------------------------


def tv_builder(name):
    def build():
        import torchvision

        return torchvision.models.get_model(name, weights=None)

    return build


def timm_builder(name):
    def build():
        import timm

        return timm.create_model(name, pretrained=False)

    return build


def long_ids(*names):
    def make():
        ids = torch.zeros((1, SEQ_LEN), dtype=torch.long)
        if len(names) == 1:
            return ids
        return {n: ids.clone() for n in names}

    return make


def transformers_specs() -> list:
    import transformers as tf

    def cfg_model(model_cls, cfg_cls, **cfg):
        def build():
            return getattr(tf, model_cls)(getattr(tf, cfg_cls)(**cfg))

        return build

    text = dict(
        input_shape=None, seq_len=SEQ_LEN, family="transformer", tools=TOOLS_TEXT, input_data=long_ids("input_ids")
    )
    specs = [
        dict(model="bert-base", build=cfg_model("BertModel", "BertConfig"), cfg="BertModel(BertConfig())", **text),
        dict(
            model="gpt2",
            build=cfg_model("GPT2LMHeadModel", "GPT2Config"),
            cfg="GPT2LMHeadModel(GPT2Config()), lm_head tied to wte",
            **text,
        ),
        dict(
            model="gpt2-large",
            build=cfg_model("GPT2LMHeadModel", "GPT2Config", n_embd=1280, n_layer=36, n_head=20),
            cfg="GPT2LMHeadModel(GPT2Config(n_embd=1280, n_layer=36, n_head=20)), tied lm_head,"
            " built on the meta device",
            meta=True,
            **{**text, "tools": ["print_counts"]},
        ),
        dict(
            model="t5-small",
            build=cfg_model(
                "T5ForConditionalGeneration", "T5Config", d_model=512, d_ff=2048, num_layers=6, num_heads=8
            ),
            cfg="T5ForConditionalGeneration(T5Config(d_model=512, d_ff=2048, num_layers=6,"
            " num_heads=8)); torchinfo gets input_ids and decoder_input_ids",
            **{**text, "input_data": long_ids("input_ids", "decoder_input_ids")},
        ),
        dict(
            model="roberta-base",
            build=cfg_model(
                "RobertaModel",
                "RobertaConfig",
                vocab_size=50265,
                max_position_embeddings=514,
                type_vocab_size=1,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                layer_norm_eps=1e-5,
            ),
            cfg="RobertaModel(RobertaConfig(vocab_size=50265, max_position_embeddings=514,"
            " type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,"
            " layer_norm_eps=1e-5))",
            **text,
        ),
        dict(
            model="distilbert-base",
            build=cfg_model("DistilBertModel", "DistilBertConfig"),
            cfg="DistilBertModel(DistilBertConfig())",
            **text,
        ),
        dict(
            model="llama-small",
            build=cfg_model(
                "LlamaForCausalLM",
                "LlamaConfig",
                hidden_size=512,
                intermediate_size=1376,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=4,
                vocab_size=32000,
            ),
            cfg="LlamaForCausalLM(LlamaConfig(hidden_size=512, intermediate_size=1376,"
            " num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,"
            " vocab_size=32000))",
            **text,
        ),
        dict(
            model="vit-base",
            build=cfg_model("ViTModel", "ViTConfig"),
            cfg="ViTModel(ViTConfig()), pixel_values 3x224x224",
            input_shape=[3, 224, 224],
            seq_len=None,
            family="transformer",
            tools=TOOLS_VISION,
            input_data=None,
        ),
    ]
    for s in specs:
        s["model"] = "transformers:" + s["model"]
        s["set"] = "zoo"
        s["kind"] = "torch"
    return specs


def zoo_specs() -> list:
    specs = []
    tv = [
        "resnet50",
        "mobilenet_v2",
        "vgg16",
        "vit_b_16",
        "efficientnet_b0",
        "densenet121",
        "convnext_tiny",
        "swin_t",
        "regnet_y_400mf",
        "squeezenet1_0",
    ]
    for name in tv:
        specs.append(
            dict(
                set="zoo",
                kind="torch",
                model=f"torchvision:{name}",
                build=tv_builder(name),
                input_shape=[3, 224, 224],
                seq_len=None,
                family="transformer" if name in ("vit_b_16", "swin_t") else "cnn",
                tools=TOOLS_VISION,
                cfg=f"torchvision.models.get_model({name!r}, weights=None)",
            )
        )
    for name in ["resnet50", "vit_small_patch16_224", "convnext_nano", "efficientnet_b0", "deit_tiny_patch16_224"]:
        specs.append(
            dict(
                set="zoo",
                kind="torch",
                model=f"timm:{name}",
                build=timm_builder(name),
                input_shape=[3, 224, 224],
                seq_len=None,
                family="transformer" if name.startswith(("vit", "deit")) else "cnn",
                tools=TOOLS_VISION,
                cfg=f"timm.create_model({name!r}, pretrained=False)",
            )
        )
    specs += transformers_specs()
    specs += keras_specs()
    return specs


def keras_specs() -> list:
    def app(name):
        def build():
            import keras

            return getattr(keras.applications, name)(weights=None, input_shape=(224, 224, 3))

        return build

    def mlp():
        import keras

        return keras.Sequential(
            [
                keras.Input(shape=(784,)),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ],
            name="mlp",
        )

    def tiny_transformer():
        import keras
        from keras import layers

        vocab, d, heads, ff = 10000, 128, 4, 512

        class PositionEmbedding(layers.Layer):
            # learned positions added to the token embeddings (keras has no such layer)
            def build(self, input_shape):
                self.positions = self.add_weight(
                    shape=tuple(input_shape[1:]), initializer="random_normal", name="positions"
                )

            def call(self, x):
                return x + self.positions

        tokens = keras.Input(shape=(SEQ_LEN,), dtype="int32", name="tokens")
        x = layers.Embedding(vocab, d, name="token_embedding")(tokens)
        x = PositionEmbedding(name="position_embedding")(x)
        for i in range(2):
            att = layers.MultiHeadAttention(num_heads=heads, key_dim=d // heads, name=f"attention_{i}")(x, x)
            x = layers.LayerNormalization(epsilon=1e-6, name=f"norm_{i}_a")(layers.Add(name=f"add_{i}_a")([x, att]))
            h = layers.Dense(ff, activation="gelu", name=f"ffn_{i}_in")(x)
            h = layers.Dense(d, name=f"ffn_{i}_out")(h)
            x = layers.LayerNormalization(epsilon=1e-6, name=f"norm_{i}_b")(layers.Add(name=f"add_{i}_b")([x, h]))
        x = layers.GlobalAveragePooling1D(name="pool")(x)
        out = layers.Dense(2, activation="softmax", name="classifier")(x)
        return keras.Model(tokens, out, name="tiny_transformer")

    specs = []
    for name, fam in [("ResNet50", "cnn"), ("MobileNetV2", "cnn"), ("VGG16", "cnn")]:
        specs.append(
            dict(
                model=f"keras:{name}",
                build=app(name),
                input_shape=[224, 224, 3],
                seq_len=None,
                family=fam,
                notes="channels last",
                cfg=f"keras.applications.{name}(weights=None, input_shape=(224, 224, 3))",
            )
        )
    specs.append(
        dict(
            model="keras:mlp_784_512_256_10",
            build=mlp,
            input_shape=[784],
            seq_len=None,
            family="mlp",
            notes="",
            cfg="Sequential: Input(784), Dense 512 relu, Dense 256 relu, Dense 10 softmax",
        )
    )
    specs.append(
        dict(
            model="keras:tiny_transformer",
            build=tiny_transformer,
            input_shape=None,
            seq_len=SEQ_LEN,
            family="transformer",
            notes="",
            cfg="functional: token Embedding (10000 x 128) + learned positions (a custom layer,"
            " 128 x 128), 2 x"
            " [MultiHeadAttention(4 heads, key_dim 32), Add, LayerNormalization,"
            " Dense 512 gelu, Dense 128, Add, LayerNormalization],"
            " GlobalAveragePooling1D, Dense 2 softmax",
        )
    )
    for s in specs:
        s.update(set="zoo", kind="keras", tools=["keras"])
    return specs


def timm_test_specs() -> list:
    models = {}
    with gzip.open(TEST_SPLIT, "rt") as f:
        for line in f:
            job = json.loads(line)["job"]
            name = job["model"]
            shape = list(job["input_shape"])
            prev = models.setdefault(name, (shape, job["family"]))
            if prev[0] != shape:
                raise SystemExit(f"{name}: two input shapes in the test split")
    specs = []
    for model, (shape, family) in sorted(models.items()):
        name = model.split(":", 1)[1]
        specs.append(
            dict(
                set="timm_test",
                kind="torch",
                model=model,
                build=timm_builder(name),
                input_shape=shape,
                seq_len=None,
                family=family,
                tools=TOOLS_TIMM_TEST,
                cfg=f"timm.create_model({name!r}, pretrained=False)",
            )
        )
    return specs


# --------------------------------------------------------------------------------------
# runners
# --------------------------------------------------------------------------------------


def row_of(spec, tool, text, params, notes) -> dict:
    return {
        "set": spec["set"],
        "model": spec["model"],
        "tool": tool,
        "family": spec["family"],
        "text": text,
        "input_shape": spec["input_shape"],
        "seq_len": spec["seq_len"],
        "params": int(params),
        "notes": notes,
    }


def run_torch_spec(spec, rows, problems, timings):
    seed_all()
    t0 = time.monotonic()
    try:
        with time_limit(BUILD_TIMEOUT_S):
            if spec.get("meta"):
                with torch.device("meta"):
                    model = spec["build"]()
            else:
                with SkipParamInit():
                    model = spec["build"]()
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()
            model.eval()
    except ToolTimeout:
        problems.append((spec, "(build)", f"build took over {BUILD_TIMEOUT_S} s; skipped"))
        return
    except Exception as exc:  # noqa: BLE001 - recorded, not hidden
        problems.append((spec, "(build)", first_line(exc)))
        return
    timings.append((spec["model"], "(build)", time.monotonic() - t0))
    params = sum(p.numel() for p in model.parameters())
    for tool in spec["tools"]:
        name, _, opt = tool.partition(":")
        t1 = time.monotonic()
        # torchsummary leaves its hooks registered when the forward pass fails: restore
        # every module's forward hooks after each tool so one failure cannot leak into the next
        saved_hooks = [(m, dict(m._forward_hooks)) for m in model.modules()]
        try:
            with time_limit(TOOL_TIMEOUT_S):
                text, notes = run_tool(tool, model, spec)
        except ToolTimeout:
            problems.append((spec, tool, f"took over {TOOL_TIMEOUT_S} s on the CPU; skipped"))
            continue
        except Exception as exc:  # noqa: BLE001 - recorded, not hidden
            problems.append((spec, tool, first_line(exc)))
            if os.environ.get("PRINTOUTS_DEBUG"):
                traceback.print_exc()
            continue
        finally:
            for m, hooks in saved_hooks:
                if m._forward_hooks != hooks:
                    m._forward_hooks.clear()
                    m._forward_hooks.update(hooks)
            dt = time.monotonic() - t1
            timings.append((spec["model"], tool, dt))
        if not text.strip():
            problems.append((spec, tool, "empty printout"))
            continue
        size = len(text.encode("utf-8"))
        if size > MAX_TEXT_BYTES:
            problems.append((spec, tool, f"printout is {size:,} bytes, over the 1 MiB limit; skipped"))
            continue
        rows.append(row_of(spec, name, text, params, notes))
    del model
    gc.collect()


def run_keras_spec(spec, rows, problems, timings):
    import keras

    keras.backend.clear_session()  # layer-name counters restart: names are reproducible
    keras.utils.set_random_seed(SEED)
    t0 = time.monotonic()
    try:
        model = spec["build"]()
        chunks = []
        model.summary(line_length=KERAS_LINE_LENGTH, print_fn=lambda s, **kw: chunks.append(s))
        text = captured(lambda: print("".join(chunks), end=""))
    except Exception as exc:  # noqa: BLE001
        problems.append((spec, "keras", first_line(exc)))
        return
    timings.append((spec["model"], "keras", time.monotonic() - t0))
    notes = "; ".join(n for n in [spec["notes"], f"line_length={KERAS_LINE_LENGTH}"] if n)
    rows.append(row_of(spec, "keras", text, model.count_params(), notes))
    del model
    gc.collect()


# --------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------


def write_jsonl_gz(path: Path, rows: list) -> None:
    raw = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        for r in rows:
            gz.write((json.dumps(r, ensure_ascii=False, sort_keys=False) + "\n").encode("utf-8"))
    path.write_bytes(raw.getvalue())


def versions() -> list:
    import importlib.metadata as md

    out = [("python", platform.python_version()), ("torch", torch.__version__)]
    for pkg in ["torchvision", "timm", "transformers", "torchinfo", "torchsummary", "keras", "rich", "numpy"]:
        try:
            out.append((pkg, md.version(pkg)))
        except md.PackageNotFoundError:
            out.append((pkg, "not installed"))
    return out


def _total(text: str):
    import re

    m = re.search(r"Total params: ([\d,]+)", text)
    return int(m.group(1).replace(",", "")) if m else None


def format_notes(rows) -> list:
    """Facts about the stored texts, computed from them."""
    from collections import Counter

    out = []
    ts = [r for r in rows if r["tool"] == "torchsummary"]
    ts_off = [r for r in ts if _total(r["text"]) != r["params"]]
    ts_lists = sorted({r["model"] for r in ts if "[[" in r["text"]})
    ts_wide = [
        r
        for r in ts
        if any(
            len(line.split()[0]) > 20
            for line in r["text"].splitlines()
            if "-" in line[:22]
            and line.strip().endswith(tuple("0123456789"))
            and not line.startswith(("Total", "Trainable", "Non-", "Input", "Forward", "Params", "Estimated"))
        )
    ]
    out.append(
        f"- torchsummary: Total params differs from the model's parameter count in"
        f" {len(ts_off)} of {len(ts)} rows (only `weight`/`bias` attributes are counted,"
        " per call); rows whose layer name (`Class-index`) is longer than 20 characters"
        f" push the row's columns right ({len(ts_wide)} rows): split on whitespace after"
        " the shape's closing bracket, not on columns. Output shapes may be a list of"
        " shapes, `[[-1, 16, 40], [-1, 197, 640]]`, for modules returning tuples"
        f" ({', '.join(ts_lists) or 'none'})."
    )
    ti = [r for r in rows if r["tool"] == "torchinfo"]
    widths = Counter(len(r["text"].splitlines()[0]) for r in ti)
    ti_off = sorted(
        {f"{r['model']} ({_total(r['text']):,} vs {r['params']:,})" for r in ti if _total(r["text"]) != r["params"]}
    )
    units = sum("Total mult-adds (Units." in r["text"] for r in ti)
    out.append(
        f"- torchinfo: the table is {', '.join(f'{w}' for w in sorted(widths))} characters"
        " wide (the first column widens with depth and name length); nesting is drawn"
        " with `├─`, `│    └─` and `│    │    └─`, each row ending `Class: depth-index`;"
        " a row whose children are shown carries only the parameters it holds itself"
        " (`--` when none; torchvision's VisionTransformer row shows 768, its class"
        " token), a row at the depth limit carries its whole subtree; modules that did"
        " not run show `--` as output shape. With torchinfo"
        f" 1.8.0 on Python {platform.python_version()} the mult-adds line reads `Total"
        f" mult-adds (Units.GIGABYTES): 4.09` (an enum formatting change; older Pythons"
        f" print `(G)`): {units} of {len(ti)} rows. Total params counts a tied tensor"
        " once per module that ran with it: " + ("; ".join(ti_off) or "none") + "."
    )
    pc = [r for r in rows if r["tool"] == "print_counts"]
    pc_off = sorted(
        {f"{r['model']} ({_total(r['text']):,} vs {r['params']:,})" for r in pc if _total(r["text"]) != r["params"]}
    )
    out.append(
        "- print / print_counts: torch 2.15 prints `LayerNorm((768,), eps=1e-12,"
        " elementwise_affine=True, bias=True)` (older torch: without `bias=True`, as in"
        " bert_base_module_print.txt) and `BatchNorm2d(..., affine=True, bias=True,"
        " track_running_stats=True)`; only `nn.ModuleList` collapses repeats, never"
        " `nn.Sequential`. print_counts footers above the distinct count (tied"
        " weights): " + ("; ".join(pc_off) or "none") + "."
    )
    out.append(
        "- keras: rich box drawing (`┏━┳┓`, `┡━╇┩`, `│`, `├─┼┤`, `└─┴┘`), a rule between"
        " every two layers, cells wrapped onto continuation lines (the layer's class"
        " in parentheses often lands on the second line) and cut with `…` when they do"
        " not fit; functional models have a fourth column `Connected to`; the footer"
        " lines start with a space and give sizes: ` Total params: 25,636,712 (97.80 MB)`;"
        " Total includes non-trainable weights (batch-norm moving statistics)."
    )
    return out


def write_md(path: Path, rows, problems, timings, specs, wall_s, gz_path: Path) -> None:
    from collections import Counter

    by = Counter(
        (r["set"], r["tool"], r["notes"] if r["tool"] == "torchinfo" and "depth=" in r["notes"] else "") for r in rows
    )
    models_per_set = Counter(s["set"] for s in specs)
    L = []
    w = L.append
    w("# printouts.jsonl.gz: provenance")
    w("")
    w("Model printouts as people paste them into gpucast (`summary.text`), for parser tests: the")
    w("exact text each tool prints for a zoo of well-known models and for the 100 timm models of")
    w("the held-out test split (`data/timm/test.jsonl.gz`). Generated by a script, not edited by")
    w("hand.")
    w("")
    w("## How it was made")
    w("")
    w("```")
    w(".venv-describe/bin/python describe/scripts/printouts.py")
    w("```")
    w("")
    w(f"- generated: {datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()}")
    w("- versions: " + ", ".join(f"{k} {v}" for k, v in versions()))
    w(
        f"- CPU only, {torch.get_num_threads()} torch threads; no weights were downloaded: torchvision"
        " `weights=None`, timm `pretrained=False`, transformers `Model(Config(...))` (gpt2-large"
    )
    w(f"  on the meta device, it is only printed), keras applications `weights=None`; seed {SEED} before each model.")
    w("- torch models are built without their random parameter init: while the model is built,")
    w("  in-place value writes on an `nn.Parameter` (`uniform_`, `normal_`, `erfinv_`, the")
    w("  `torch.nn.init` functions, ...) are skipped by a `TorchFunctionMode`, buffers are computed")
    w("  as usual, and the parameters are zero-filled afterwards (convnext_xxlarge builds in 0.1 s")
    w("  instead of 30 s). No printout depends on the weights' values: runs with ordinary random")
    w("  init gave byte-identical texts for all 150 torch rows compared (31 models: the torch zoo")
    w("  and 9 timm_test models, the largest among them).")
    w(
        f"- wall time: {wall_s / 60:.1f} min; each tool call limited to {TOOL_TIMEOUT_S} s, each"
        f" build to {BUILD_TIMEOUT_S} s"
    )
    try:
        shown = gz_path.resolve().relative_to(REPO)
    except ValueError:
        shown = gz_path
    w(
        f"- output: `{shown}`, {gz_path.stat().st_size:,} bytes, {len(rows)}"
        " rows, sorted by set, model, tool, notes; gzip with mtime 0"
    )
    w("")
    w("## Rows")
    w("")
    w("One JSON object per line: `set` (`zoo` | `timm_test`), `model` (`torchvision:<name>`,")
    w("`timm:<name>`, `transformers:<name>`, `keras:<name>`), `tool`, `family` (`cnn` |")
    w("`transformer` | `mlp`), `text` (exactly what was printed, ending with the printed")
    w("newline), `input_shape` (per sample: `[C, H, W]` for torch vision models, `[224, 224, 3]`")
    w("channels last for keras applications, `[784]` for the keras MLP; null for token models),")
    w("`seq_len` (tokens per sample, 128, for token models; else null), `params` (distinct")
    w("parameters: `sum(p.numel() for p in model.parameters())`, tied tensors once; for keras")
    w("`model.count_params()`, which includes non-trainable weights such as batch-norm moving")
    w("statistics), `notes`.")
    w("")
    w("| set | tool | rows |")
    w("|---|---|---|")
    for (s, t, n), c in sorted(by.items()):
        w(f"| {s} | {t}{' (' + n + ')' if n else ''} | {c} |")
    w("")
    for s, c in sorted(models_per_set.items()):
        w(f"- models in `{s}`: {c}")
    w("")
    w("## Tools")
    w("")
    w(
        '- `torchsummary`: `torchsummary.summary(model, input_shape, device="cpu")`'
        " (torchsummary 1.5.1; stdout captured; run under `torch.no_grad()`, model in eval mode)."
    )
    w("  It feeds `torch.rand(2, *input_shape)` (float) and prints one row per call of every")
    w("  module that is not the model itself, an `nn.Sequential` or an `nn.ModuleList`")
    w("  (containers included, so rows nest without any marker); `Param #` counts only the")
    w("  module's `weight` and `bias` attributes, so its Total params misses other parameters")
    w("  (class tokens, position embeddings, layer-scale gammas) and counts a module called twice")
    w("  twice. Output shapes start with -1 (the batch); a module returning a tuple gets a list")
    w("  of shapes. Token models (float ids) are tried too and fail in the embedding.")
    w("- `torchinfo`: `str(torchinfo.summary(model, input_size=(1, *input_shape), verbose=0,")
    w('  device="cpu"))` (default depth 3, eval mode, no_grad), printed; token models get')
    w("  `input_data=` a long tensor of zeros `(1, 128)` (T5: a dict with `input_ids` and")
    w("  `decoder_input_ids`). A second row with `notes` `depth=10` passes `depth=10` (zoo only).")
    w("- `print`: `print(model)`.")
    w("- `print_counts`: `print(model)` annotated as GPUMemNet's test pipeline writes module prints")
    w("  (the style of `bert_base_module_print.txt`): the module tree is re-printed with torch 2.x's")
    w("  `nn.Module.__repr__`/`_addindent` logic, and every module's text gets")
    w("  `, N params` appended (after a leaf's one-line repr, after a container's closing")
    w("  parenthesis), N = `sum(p.numel() for p in module.parameters())` with thousands")
    w("  separators; `nn.ModuleList` children collapse as torch prints them (`(0-11): 12 x")
    w("  BertLayer(`), one annotated copy, the list's own count being all copies. Children")
    w("  collapse when their annotated texts are identical (same repr and same count). A module")
    w("  class with its own `__repr__` is printed with that repr, annotated only at its end (the")
    w("  row's notes name such classes). Footer: a line of 41 `=`, then `Total params:`,")
    w("  `Trainable params:`, `Non-trainable params:`, where Total is the sum over all modules")
    w("  (`named_modules(remove_duplicate=False)`) of each module's own direct parameters")
    w("  (`parameters(recurse=False)`): a tensor held by two modules (GPT-2's `lm_head.weight` is")
    w("  `transformer.wte.weight`) counts once per holder, so with tied weights the footer")
    w("  exceeds the row's `params` and the root line (GPT-2: 163,037,184 vs 124,439,808), as")
    w("  GPUMemNet's footers do. The counts on the lines also include the shared tensor in each")
    w("  holder (GPT-2's `transformer` line and `lm_head` line both count wte).")
    w("- `print_counts_dataparallel`: the same of `torch.nn.DataParallel(model)` (constructed on")
    w("  this CPU-only machine, it keeps the module and `device_ids=[]`): the root is")
    w("  `DataParallel(` with one child `(module): ...`, every line indented two more spaces.")
    w(f"- `keras`: keras 3 with `KERAS_BACKEND=torch`, `model.summary(line_length={KERAS_LINE_LENGTH}, print_fn=...)`;")
    w("  with a `print_fn`, keras renders through rich without a terminal or colours and hands")
    w("  the whole captured text over at once; it is stored as printed. `keras.backend.clear_session()`")
    w("  before each model keeps the auto-generated layer names reproducible.")
    w("")
    w("## What the formats look like (for parser authors)")
    w("")
    for line in format_notes(rows):
        w(line)
    w("")
    w("## Zoo models")
    w("")
    for s in specs:
        if s["set"] == "zoo":
            w(f"- `{s['model']}`: {s['cfg']}; tools: {', '.join(s['tools'])}")
    w("")
    w("## Failures and skips")
    w("")
    if not problems:
        w("None.")
    else:
        w("Every tool call that produced no row, with the reason (first line of the error):")
        w("")
        w("| set | model | tool | reason |")
        w("|---|---|---|---|")
        for spec, tool, reason in sorted(problems, key=lambda p: (p[0]["set"], p[0]["model"], p[1])):
            reason = reason.replace("|", "\\|").replace("\n", " ")
            w(f"| {spec['set']} | `{spec['model']}` | {tool} | {reason} |")
    w("")
    w("## Slowest tool calls")
    w("")
    for m, t, dt in sorted(timings, key=lambda x: -x[2])[:10]:
        w(f"- `{m}` {t}: {dt:.1f} s")
    w("")
    path.write_text("\n".join(L))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="run only models whose name contains one of these")
    ap.add_argument(
        "--out-dir", type=Path, help="where to write (default: the fixtures directory; a temp dir with --only)"
    )
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    torch.set_flush_denormal(True)
    specs = zoo_specs() + timm_test_specs()
    if args.only:
        specs = [s for s in specs if any(o in s["model"] for o in args.only)]
    out_dir = args.out_dir or (Path(tempfile.mkdtemp(prefix="printouts-")) if args.only else FIXTURES)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, problems, timings = [], [], []
    t0 = time.monotonic()
    for i, spec in enumerate(specs, 1):
        ts = time.monotonic()
        if spec["kind"] == "keras":
            run_keras_spec(spec, rows, problems, timings)
        else:
            run_torch_spec(spec, rows, problems, timings)
        print(f"[{i}/{len(specs)}] {spec['model']} {time.monotonic() - ts:.1f} s", file=sys.stderr, flush=True)
    wall = time.monotonic() - t0
    rows.sort(key=lambda r: (r["set"], r["model"], r["tool"], r["notes"]))
    gz_path = out_dir / "printouts.jsonl.gz"
    write_jsonl_gz(gz_path, rows)
    write_md(out_dir / "PRINTOUTS.md", rows, problems, timings, specs, wall, gz_path)
    print(f"{len(rows)} rows, {len(problems)} failures/skips -> {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
