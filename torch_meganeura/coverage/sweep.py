"""OpInfo coverage: run torch's operator database through ``backend="meganeura"`` and classify every sample.

``python -m torch_meganeura.coverage`` takes each OpInfo of ``op_db`` (or those named by ``--ops``), a few of its
CPU sample inputs (float32; int64 or bool where the op has no float32; or, with ``--dtype``, bfloat16 or float16),
compiles a fresh function calling the op with ``torch.compile(backend="meganeura")``, runs it forward and, for
differentiable ops, backward (gradients of ``(out * cotangent).sum()`` for a fixed random cotangent, with respect
to every float input that requires grad), and compares with eager PyTorch. Each sample is one of:

- ``lowered``: every aten op of every graph ran on the device, outputs and gradients are correct;
- ``fell-back``: correct, but some op ran in eager PyTorch (the backend's own fallback records, or a graph
  break / no graph from dynamo), with the ops and reasons;
- ``wrong``: an output or gradient differs from eager beyond tolerance, or its shape or dtype does;
- ``error``: the compiled run raised (type and first line recorded), hung or crashed the worker, or the
  harness itself could not handle the sample (``coverage harness: ...``);
- ``skipped``: eager PyTorch itself raises on the sample (an error-input sample), torch.compile fails the same
  way with the ``aot_eager`` backend, or the op has no sample in the dtypes tried.

That is the backend path (``--path backend``, the default). ``--path step`` runs each sample through the resident
training step instead (``compile_train_step``: loss, gradients and one SGD update; ``coverage_step``), ``--path
both`` through both; the step's result of each sample is under its ``"step"`` key (``coverage_report.of_path``).

Correctness (``coverage_compare``): an element passes if it is within atol 1e-5 + rtol of eager in the sample's
dtype (1e-5 in float32, one unit in the last place in a half dtype), or, where the op runs in float64, within the
same tolerance plus 4x eager's largest error of the eager float64 result.
Random and uninitialised ops (``NONDETERMINISTIC``) are compared on shape and dtype only. Samples run in a
worker process, so a hang or crash costs one op, not the sweep. The JSON report has every sample; the markdown
report (``coverage/opinfo.md``) has one row per op.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import multiprocessing
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass

import torch
import wgpu
from torch.utils import _pytree as pytree

from meganeura.runtime.device import get_device

from . import report as coverage_report, step as coverage_step
from ..backend.entry import BackendContext
from .compare import compare

STATUSES = coverage_report.STATUSES
PATHS = {"backend": ("backend",), "step": ("step",), "both": ("backend", "step")}  # --path -> paths run
NONDETERMINISTIC = frozenset({
    "bernoulli", "cauchy", "empty", "empty_like", "empty_permuted", "empty_strided", "exponential", "geometric",
    "log_normal", "multinomial", "new_empty", "new_empty_strided", "normal", "rand_like", "randint",
    "randint_like", "randn", "randn_like", "uniform", "nn.functional.alpha_dropout", "nn.functional.dropout",
    "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.feature_alpha_dropout",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "nn.functional.rrelu",
})  # OpInfo names (without the variant) whose values are random or uninitialised
RANDOM_WHEN = {  # ops with random values for some samples only: dropout inside attention
    "nn.functional.scaled_dot_product_attention": lambda sample: sample.kwargs.get("dropout_p", 0.0) > 0.0,
    "nn.functional.multi_head_attention_forward": lambda sample: bool(sample.kwargs.get("training", False)),
}


class EagerFailure(Exception):
    """Eager PyTorch (or torch.compile with aot_eager) raised on a sample: the sample is skipped."""


def full_name(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _call_unseeded(op, *args, **kwargs):
    return op(*args, **kwargs)


def select_ops(names: list[str] | None) -> list:
    """OpInfos of ``op_db``, or those whose full name or base name is in ``names`` (all variants).

    Random ops of op_db call their op through ``wrapper_set_seed``, which saves and restores torch's RNG state
    (dynamo breaks the graph there, so nothing would reach the backend); it is replaced by a plain call, and
    ``run_sample`` seeds torch before each run instead."""
    # torch's test suite takes seconds to import and only the sweep reads it: imported when the sweep selects ops
    from torch.testing._internal import common_methods_invocations  # noqa: PLC0415
    from torch.testing._internal.common_methods_invocations import op_db  # noqa: PLC0415

    common_methods_invocations.wrapper_set_seed = _call_unseeded

    if not names:
        return list(op_db)
    chosen = [op for op in op_db if full_name(op) in names or op.name in names]
    unknown = set(names) - {full_name(op) for op in chosen} - {op.name for op in chosen}
    if unknown:
        raise SystemExit(f"unknown OpInfo name(s): {', '.join(sorted(unknown))}")
    return chosen


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # --dtype
WIDENED = (torch.float32, torch.bfloat16, torch.float16)  # sample dtypes whose float64 reference is computed


def sample_dtype(op, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
    """The dtype of the op's samples in a sweep of ``dtype``: float32's sweep takes int64 or bool where the op has
    no float32; a half dtype's sweep takes only that dtype."""
    for candidate in (dtype, torch.int64, torch.bool) if dtype == torch.float32 else (dtype,):
        if candidate in op.dtypes:
            return candidate
    return None


# ---------------------------------------------------------------------------------------------------- one sample

@dataclass
class Call:
    """One sample as a function of its tensors: ``fn(*tensors)`` calls the op with everything else fixed."""

    fn: object
    tensors: list
    process: object  # the sample's output_process_fn_grad

    @classmethod
    def of(cls, op, sample) -> "Call":
        leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        target = op.op

        def fn(*tensors):
            filled = list(leaves)
            for i, t in zip(slots, tensors):
                filled[i] = t
            inp, args, kwargs = pytree.tree_unflatten(filled, spec)
            return target(inp, *args, **kwargs)

        return cls(fn, [leaves[i] for i in slots], sample.output_process_fn_grad)

    def inputs(self, to64: bool = False) -> list:
        """Fresh copies of the tensors (float32 and half ones as float64 with ``to64``), requires_grad as
        sampled."""
        out = []
        for t in self.tensors:
            copy = t.detach().clone()
            if to64 and copy.dtype in WIDENED:
                copy = copy.double()
            out.append(copy.requires_grad_(t.requires_grad))
        return out


@dataclass
class Result:
    """Outputs and gradients of one run (leaves of the output structure after output_process_fn_grad)."""

    outputs: list
    spec: object
    grads: list
    loss: torch.Tensor | None = None  # sum of (outputs * cotangents), where differentiated


def run_call(call: Call, fn, inputs: list, cotangents: list | None, backward: bool) -> tuple[Result, list | None]:
    """Call ``fn`` and, with ``backward``, differentiate (outputs * cotangents).sum(); new cotangents if None."""
    out = call.process(fn(*inputs))
    leaves, spec = pytree.tree_flatten(out)
    grads, loss = [], None
    wrt = [t for t in inputs if t.requires_grad]
    diff = differentiable(leaves)
    if backward and wrt and diff:
        cots = cotangents or [torch.randn(x.shape, dtype=x.dtype) for x in diff]
        loss = cotangent_loss(diff, cots)
        grads = [torch.zeros_like(t) if g is None else g
                 for t, g in zip(wrt, torch.autograd.grad(loss, wrt, allow_unused=True))]
        cotangents, loss = cots, loss.detach()
    leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
    return Result(leaves, spec, grads, loss), cotangents


def differentiable(leaves: list) -> list:
    """The output leaves that require grad, complex ones viewed as real (the loss is real)."""
    diff = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    return [torch.view_as_real(x.resolve_conj()) if x.is_complex() else x for x in diff]


def cotangent_loss(diff: list, cotangents: list) -> torch.Tensor:
    """The loss whose gradients the sweep compares: the sum over differentiable outputs of (out * cotangent)."""
    return sum((x * c.to(x.dtype)).sum() for x, c in zip(diff, cotangents))


def eager_references(call: Call, op, backward: bool):
    """Eager results (in the sample's dtype), the cotangents used, and float64 results where the op runs in
    float64."""
    torch.manual_seed(0)
    try:
        ref32, cots = run_call(call, call.fn, call.inputs(), None, backward)
    except Exception as err:  # noqa: BLE001 - an error-input sample
        raise EagerFailure(f"eager raises {type(err).__name__}: {first_line(err)}") from err
    ref64 = None
    if torch.float64 in op.dtypes and any(t.dtype in WIDENED for t in call.tensors):
        try:
            ref64, _ = run_call(call, call.fn, call.inputs(to64=True), cots, backward)
        except Exception:  # noqa: BLE001 - some samples mix dtypes that float64 breaks; float32 alone then
            ref64 = None
    return ref32, cots, ref64


def first_line(err) -> str:
    """The first line of an exception's message (or of a string), at most 300 characters."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


def root_cause(err: BaseException) -> BaseException:
    """The backend's own exception inside dynamo's wrappers."""
    inner = getattr(err, "inner_exception", None)
    return root_cause(inner) if inner is not None else err


def error_entry(err: BaseException) -> dict:
    """An "error" result for an exception of the compiled run: its type, first line and innermost frame."""
    cause = root_cause(err)
    return {"status": "error", "error": f"{type(cause).__name__}: {first_line(cause)}",
            "where": traceback.format_exception(cause)[-2].strip()[:300] if cause.__traceback__ else ""}


def is_random(op, sample) -> bool:
    """Whether the sample's values are random or uninitialised (then only shapes and dtypes can be compared)."""
    return op.name in NONDETERMINISTIC or RANDOM_WHEN.get(op.name, lambda _: False)(sample)


def compiled_run(call: Call, backward: bool, cots):
    """Run the sample compiled with meganeura; return the result and what ran in eager PyTorch."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    records: list = []
    BackendContext.recorders.append(records)
    try:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result, _ = run_call(call, torch.compile(call.fn, backend="meganeura"), call.inputs(), cots, backward)
    finally:
        BackendContext.recorders.remove(records)
    return result, eager_ops(records)


def eager_ops(records: list) -> dict[str, str]:
    """aten op -> why it ran in eager PyTorch, from the backend's records and dynamo's graph-break counters."""
    out: dict[str, str] = {}
    graphs = 0
    for rec in records:
        if isinstance(rec, dict) and rec["kind"] == "failed":
            out["<partition>"] = f"compiling a device partition failed: {rec['error']}"[:300]
        elif isinstance(rec, dict):
            graphs += 1
            out.update(rec["fallback_ops"])
    out.update(dynamo_fallbacks())
    if graphs == 0 and not any(key.startswith(BACKEND_EXCEPTION) for key in out):
        out["<no graph>"] = "dynamo compiled no graph: the call ran in Python/eager"
    return out


BACKEND_EXCEPTION = "<backend exception>"


def dynamo_fallbacks() -> dict[str, str]:
    """Graph breaks, and backend exceptions that dynamo turned into graph breaks (the frame then runs in eager
    PyTorch), from dynamo's counters: key -> what happened."""
    counters = torch._dynamo.utils.counters
    out = {f"<graph break> {first_line(reason)}"[:200]: f"dynamo graph break ({n}x)"
           for reason, n in counters["graph_break"].items()}
    for reason, n in counters["unimplemented"].items():
        lines = [line.strip() for line in reason.splitlines()]
        explanation = next((line for line in lines if line.startswith("Explanation:")), lines[0])
        if lines[0] == "Backend compiler exception":
            failed = explanation.split(" failed with ", 1)[-1].split(". Adding")[0]
            out[f"{BACKEND_EXCEPTION} {failed}"[:200]] = "the backend raised; dynamo ran the frame in eager PyTorch"
        else:
            out[f"<dynamo> {lines[0]}"[:200]] = f"{explanation} ({n}x)"[:300]
    return out


def aot_eager_fails(call: Call, backward: bool, cots) -> str | None:
    """torch.compile's own failure on this sample (aot_eager, no meganeura: it raises, or dynamo reports a
    backend exception), or None if it runs."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run_call(call, torch.compile(call.fn, backend="aot_eager"), call.inputs(), cots, backward)
    except Exception as err:  # noqa: BLE001
        cause = root_cause(err)
        return f"torch.compile with aot_eager raises {type(cause).__name__}: {first_line(cause)}"
    failed = [key for key in dynamo_fallbacks() if key.startswith(BACKEND_EXCEPTION)]
    return "torch.compile with aot_eager fails the same way" if failed else None


def run_sample(op, sample, backward: bool) -> dict:
    start = time.perf_counter()
    call = Call.of(op, sample)
    backward = backward and op.supports_autograd and any(t.requires_grad for t in call.tensors)
    entry = {"backward": backward, "values": not is_random(op, sample)}
    try:
        ref32, cots, ref64 = eager_references(call, op, backward)
        try:
            got, fallbacks = compiled_run(call, backward, cots)
        except Exception as err:  # noqa: BLE001 - one sample's failure must not stop the sweep
            torch_failure = aot_eager_fails(call, backward, cots)
            if torch_failure:
                raise EagerFailure(torch_failure) from err
            entry.update(error_entry(err))
        else:
            entry.update(compare(got, ref32, ref64, entry["values"]), fallback_ops=fallbacks)
            if entry["status"] == "ok":
                entry.update(status_when_correct(fallbacks, call, backward, cots))
    except EagerFailure as err:
        entry.update(status="skipped", reason=str(err))
    except Exception as err:  # noqa: BLE001 - a sample the harness cannot handle is reported, not fatal
        entry.update(status="error", error=f"coverage harness: {type(err).__name__}: {first_line(err)}")
    entry["seconds"] = round(time.perf_counter() - start, 3)
    return entry


def status_when_correct(fallbacks: dict, call: Call, backward: bool, cots) -> dict:
    """lowered or fell-back; error where the backend raised and dynamo hid it behind a graph break, unless
    torch.compile fails the same way with aot_eager (then it is torch's limitation: fell-back)."""
    hidden = [key for key in fallbacks if key.startswith(BACKEND_EXCEPTION)]
    if hidden:
        torch_failure = aot_eager_fails(call, backward, cots)
        failed = hidden[0].removeprefix(BACKEND_EXCEPTION).strip()
        if torch_failure is None:
            return {"status": "error", "error": f"the backend raised (dynamo ran the frame in eager PyTorch): {failed}"}
        del fallbacks[hidden[0]]
        fallbacks[f"<torch.compile fails> {failed}"] = f"{torch_failure}; dynamo runs the frame in eager PyTorch"
    return {"status": "fell-back" if fallbacks else "lowered"}


# ---------------------------------------------------------------------------------------------------- one op

def run_op(op, max_samples: int, backward: bool, paths: tuple = ("backend",),
           sweep_dtype: torch.dtype = torch.float32) -> dict:
    """The op's entry: its first ``max_samples`` samples in ``sweep_dtype`` (``sample_dtype``), each run through
    every path of ``paths`` ("backend", "step"), with the op's status per path."""
    dtype = sample_dtype(op, sweep_dtype)
    if dtype is None:
        tried = "float32, int64 or bool" if sweep_dtype == torch.float32 else str(sweep_dtype).removeprefix("torch.")
        return with_statuses({"dtype": None, "samples": [
            for_paths(paths, {"status": "skipped", "reason": f"no {tried} dtype"})]}, paths)
    grad = (backward or "step" in paths) and op.supports_autograd and dtype in WIDENED
    try:
        samples = list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=grad), max_samples))
    except Exception as err:  # noqa: BLE001
        samples, reason = [], f"sample_inputs raises {type(err).__name__}: {first_line(err)}"
    else:
        reason = "no sample inputs"
    results = []
    for sample in samples:
        entry = run_sample(op, sample, backward) if "backend" in paths else {}
        if "step" in paths:
            entry["step"] = coverage_step.run_sample(op, sample)
        results.append(entry)
    return with_statuses({"dtype": str(dtype).removeprefix("torch."),
                          "samples": results or [for_paths(paths, {"status": "skipped", "reason": reason})]}, paths)


def for_paths(paths: tuple, result: dict) -> dict:
    """A sample entry with the same ``result`` for every path (an op without samples, a crashed worker)."""
    entry = dict(result) if "backend" in paths else {}
    if "step" in paths:
        entry["step"] = dict(result)
    return entry


def with_statuses(entry: dict, paths: tuple) -> dict:
    """``entry`` with its op status for each path: the backend's as "status", the step's as step.status."""
    if "backend" in paths:
        entry["status"] = op_status(entry["samples"])
    if "step" in paths:
        entry["step"] = {"status": op_status([s["step"] for s in entry["samples"]])}
    return entry


def op_status(samples: list[dict]) -> str:
    """The worst sample's status (skipped samples count only when all are skipped)."""
    order = ("wrong", "error", "fell-back", "lowered", "skipped")
    return min((s["status"] for s in samples), key=order.index)


# ---------------------------------------------------------------------------------------------------- the worker

def _worker(conn, max_samples: int, backward: bool, paths: tuple, dtype: torch.dtype) -> None:
    """Runs ops by name as the parent sends them; answers each with its report entry."""
    logging.getLogger("torch_meganeura").setLevel(logging.ERROR)
    by_name = {full_name(op): op for op in select_ops(None)}
    conn.send({"adapter": get_device().describe()})
    while (name := conn.recv()) is not None:
        conn.send(run_op(by_name[name], max_samples, backward, paths, dtype))


class Worker:
    """A child process running ops (spawned, so a crash or hang in one op is contained)."""

    def __init__(self, max_samples: int, backward: bool, paths: tuple, dtype: torch.dtype):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, max_samples, backward, paths, dtype), daemon=True)
        self.process.start()
        self.adapter = self._receive(600)["adapter"]
        self.done = 0

    def _receive(self, timeout: float) -> dict:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer after {timeout:.0f} s")
        return self.conn.recv()

    def run(self, name: str, timeout: float) -> dict:
        self.conn.send(name)
        self.done += 1
        return self._receive(timeout)

    def failure(self, err: Exception) -> str:
        """Stop a worker that hung or died while running an op; say which."""
        if isinstance(err, TimeoutError):
            self.stop()
            return f"hang: {err} (worker killed)"
        self.process.join(30)
        code = self.process.exitcode
        self.stop()
        return f"worker crashed (exit code {code})"

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()


def sweep(names: list[str], max_samples: int, backward: bool, timeout: float, restart_every: int,
          progress=print, paths: tuple = ("backend",), dtype: torch.dtype = torch.float32) -> tuple[dict, str]:
    """Run every op in a worker (``timeout`` seconds each); restart it after a crash, a timeout or
    ``restart_every`` ops."""
    ops, worker, adapter = {}, None, ""
    try:
        for k, name in enumerate(names):
            if worker is None or worker.done >= restart_every:
                if worker is not None:
                    worker.stop()
                worker = Worker(max_samples, backward, paths, dtype)
                adapter = worker.adapter
            start = time.perf_counter()
            try:
                entry = worker.run(name, timeout)
            except (TimeoutError, EOFError, OSError) as err:
                why = worker.failure(err)
                worker = None
                entry = with_statuses({"dtype": None, "samples": [for_paths(paths, {"status": "error", "error": why})]},
                                      paths)
            ops[name] = entry
            statuses = ", ".join(f"{path} {coverage_report.of_path(entry, path)['status']}" for path in paths)
            progress(f"[{k + 1}/{len(names)}] {name}: {statuses} ({time.perf_counter() - start:.1f} s)")
    finally:  # also on Ctrl-C or SIGTERM (main turns it into SystemExit): no orphaned worker
        if worker is not None:
            worker.stop()
    return ops, adapter


def build_report(ops: dict, adapter: str, argv: list[str], args, seconds: float) -> dict:
    """The JSON report: the run, then per path its counts (the backend's as "counts", the step's as
    step.counts), then every op."""
    paths = PATHS[args.path]
    report = {
        "command": " ".join(["python -m torch_meganeura.coverage", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__, "wgpu": wgpu.__version__, "adapter": adapter, "paths": list(paths),
        "max_samples": args.max_samples, "backward": not args.no_backward, "dtype": args.dtype,
        "seconds": round(seconds, 1),
    }
    samples = [s for entry in ops.values() for s in entry["samples"]]
    of = coverage_report.of_path
    for path in paths:
        counts = {"ops": {s: sum(of(e, path)["status"] == s for e in ops.values()) for s in STATUSES},
                  "samples": {s: sum(of(x, path)["status"] == s for x in samples) for s in STATUSES}}
        if path == "backend":
            report["counts"] = counts
        else:
            report["step"] = {"counts": counts}
    report["ops"] = ops
    return report


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m torch_meganeura.coverage",
        description="Run torch's OpInfo database (op_db) through backend='meganeura' and report, per op and "
                    "sample, whether it was lowered to the device, fell back to eager PyTorch, computed a "
                    "wrong result or raised. Samples run in a worker process; a crash or hang costs one op.")
    parser.add_argument("--ops", nargs="+", metavar="NAME",
                        help="OpInfo names (with .variant, or the base name for all variants); default: all")
    parser.add_argument("--max-samples", type=int, default=2, metavar="N", help="samples per op (default 2)")
    parser.add_argument("--json", default="coverage/opinfo.json", metavar="PATH",
                        help="JSON report with every sample (default coverage/opinfo.json)")
    parser.add_argument("--markdown", default="coverage/opinfo.md", metavar="PATH",
                        help="markdown table, one row per op (default coverage/opinfo.md)")
    parser.add_argument("--path", choices=sorted(PATHS), default="backend",
                        help="what runs each sample: torch.compile(backend='meganeura') (backend, the default), "
                             "the resident training step compile_train_step with SGD (step), or both")
    parser.add_argument("--no-backward", action="store_true", help="backend path forward only (no gradients)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="the samples' dtype: float32 (int64 or bool where an op has none; the default) or a "
                             "half dtype (ops without it are skipped; backend path only)")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="S",
                        help="seconds per sample and path (an op gets S x N x paths) before its worker counts as "
                             "hung and is restarted (default 120)")
    parser.add_argument("--restart-every", type=int, default=40, metavar="K",
                        help="start a fresh worker after K ops, bounding memory growth (default 40)")
    args = parser.parse_args(argv)
    if args.dtype != "float32" and args.path != "backend":
        parser.error("--dtype bfloat16 or float16 sweeps the backend path only (--path backend)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = [full_name(op) for op in select_ops(args.ops)]
    start = time.perf_counter()
    paths = PATHS[args.path]
    ops, adapter = sweep(names, args.max_samples, not args.no_backward, args.timeout * args.max_samples * len(paths),
                         args.restart_every, progress=lambda line: print(line, flush=True), paths=paths,
                         dtype=DTYPES[args.dtype])
    report = build_report(ops, adapter, argv, args, time.perf_counter() - start)
    coverage_report.write(report, args.json, args.markdown)
    print(coverage_report.summary(report))
    return 0

