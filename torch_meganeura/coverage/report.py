"""Writes the OpInfo coverage report (``torch_meganeura.coverage``) as JSON and as a markdown table per op.

A report holds one result per sample for each path it ran (``report["paths"]``): the backend path's at the top level
of the report, op entry and sample (``counts``, ``status``, ...), the training step path's under their ``"step"`` key
(``of_path``)."""
from __future__ import annotations

import collections
import json
import os
import re

from .compare import PRECISION_BOUND, PRECISION_FLOOR

STATUSES = ("lowered", "fell-back", "wrong", "error", "skipped")
NOTE_CHARS = 160
TITLES = {"backend": 'backend="meganeura"', "step": "the resident training step (compile_train_step)"}
STEP_TEXT = (
    "Each differentiable sample whose inputs that require grad are float32 becomes a module with those inputs as "
    "parameters (`t{i}`: the sample's i-th tensor), the inputs that the op changes in place (running statistics) "
    "as buffers, and the backend path's loss (sum of outputs times fixed random cotangents), run through "
    "`compile_train_step` with `torch.optim.SGD(lr=0.1)`: the loss and gradients (`gradients()`), then one step's "
    "loss, updated parameters and buffers, are compared with eager PyTorch by the same rules. fell-back: "
    "compile_train_step refused the sample (an op without a device lowering), or dynamo broke the loss's graph and "
    "the step ran it as several device graphs with eager PyTorch between them. Random and non-differentiable ops, "
    "and samples without dense float32 inputs that require grad, are skipped.")


def of_path(part: dict, path: str) -> dict:
    """``path``'s part of a report, op entry or sample: the backend's is at the top level, the step's under "step"."""
    return part if path == "backend" else part["step"]


def write(report: dict, json_path: str | None, markdown_path: str | None) -> None:
    for path, text in ((json_path, json.dumps(report, indent=1, sort_keys=False)), (markdown_path, markdown(report))):
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(text + "\n")


def fallback_counts(report: dict, path: str) -> collections.Counter:
    """(fallback op, reason) -> number of samples in which the op ran in eager PyTorch (the backend path) or kept
    the step from compiling (the step path) for that reason."""
    counts = collections.Counter()
    for entry in report["ops"].values():
        for sample in entry["samples"]:
            fallbacks = of_path(sample, path).get("fallback_ops", {})
            counts.update((op, re.sub(r" \(\d+x\)$", "", why)) for op, why in fallbacks.items())
    return counts


def summary(report: dict) -> str:
    n_samples = sum(len(entry["samples"]) for entry in report["ops"].values())
    lines = [f"{len(report['ops'])} ops, {n_samples} samples in {report['seconds']:.0f} s "
             f"(torch {report['torch']}, wgpu {report['wgpu']}, {report['adapter']})"]
    for path in report["paths"]:
        counts = of_path(report, path)["counts"]
        lines += [f"{path} {what}:".ljust(17) + ", ".join(f"{s} {counts[what][s]}" for s in STATUSES)
                  for what in ("ops", "samples")]
    if "backend" in report["paths"]:
        imprecise = imprecise_samples(report)
        lines.append(f"backend precision: {len(imprecise)} correct samples farther from float64 than "
                     f"{PRECISION_BOUND:g}x eager's error (or {PRECISION_FLOOR:g})")
    return "\n".join(lines)


def imprecise_samples(report: dict) -> list[tuple[float, str, int]]:
    """(precision, op, sample index) of the backend path's correct samples above PRECISION_BOUND, worst first."""
    found = [(s["precision"], name, i) for name, entry in report["ops"].items()
             for i, s in enumerate(entry["samples"])
             if s.get("status") in ("lowered", "fell-back") and s.get("precision", 0.0) > PRECISION_BOUND]
    return sorted(found, reverse=True)


def note(entry: dict, path: str) -> str:
    """What a reader needs about an op's worst samples: the mismatch, the error, the fallbacks or the skip."""
    status = of_path(entry, path)["status"]
    picked = [of_path(s, path) for s in entry["samples"] if of_path(s, path)["status"] == status]
    if status == "wrong":
        text = picked[0].get("mismatch", "")
    elif status == "error":
        text = picked[0].get("error", "")
    elif status == "fell-back":
        text = ", ".join(sorted({op for s in picked for op in s.get("fallback_ops", {})}))
    elif status == "skipped":
        text = picked[0].get("reason", "")
    else:
        text = "" if all(s.get("values", True) for s in picked) else "shape and dtype only (random values)"
    return _cell(text)


def _cell(text: str) -> str:
    """``text`` as one markdown table cell of at most NOTE_CHARS characters."""
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= NOTE_CHARS else text[: NOTE_CHARS - 3] + "..."


def _error(entry: dict, path: str) -> str:
    errors = [of_path(s, path)["max_abs_error"] for s in entry["samples"] if "max_abs_error" in of_path(s, path)]
    return f"{max(errors):.2g}" if errors else ""


def markdown(report: dict) -> str:
    """The report as markdown: the run and its summary, then per path the most common fallbacks and a row per op."""
    paths = report["paths"]
    runs = []
    if "backend" in paths:
        runs.append("forward and backward" if report["backward"] else "forward only")
    if "step" in paths:
        runs.append("the resident training step" + (" too (section below)" if "backend" in paths else " only"))
    dtype = report.get("dtype", "float32")  # reports written before --dtype are float32's
    lines = [
        f"<!-- generated by `{report['command'].strip()}`; do not edit -->",
        "# OpInfo coverage of " + " and ".join(TITLES[path] for path in paths)
        + ("" if dtype == "float32" else f" in {dtype}"),
        "",
        f"Generated by `{report['command'].strip()}` on {report['date']}: torch {report['torch']}, "
        f"wgpu {report['wgpu']}, adapter {report['adapter']}; at most {report['max_samples']} samples per op, "
        f"{'; '.join(runs)}; samples in {dtype}"
        + (" (int64 or bool where an op has no float32)" if dtype == "float32" else
           " (ops without it skipped); within one unit in the last place of eager, or of float64 by eager's error")
        + f"; {report['seconds'] / 60:.0f} min. The status of an op is that of its worst sample. "
        + ("Random and uninitialised ops (rand*, normal, bernoulli, dropout, empty*, ...) are compared on shape and "
           "dtype only. " if "backend" in paths else "")
        + "Every sample is in the JSON report beside this file.",
        "",
        "```",
        summary(report),
        "```",
    ]
    if "backend" in paths:
        imprecise = imprecise_samples(report)
        lines += ["", f"Correct samples farther from float64 than {PRECISION_BOUND:g}x eager's own error (precision: "
                  "our relative L2 from float64 over eager's):", "", "| op | sample | precision |", "|---|---|---|"]
        lines += [f"| {name} | {i} | {ratio:.2f} |" for ratio, name, i in imprecise]
        lines += ["", "Ops that ran in eager PyTorch most often (samples):", *op_tables(report, "backend")]
    if "step" in paths:
        lines += ["", "## The resident training step (compile_train_step)", "", STEP_TEXT, "",
                  "Ops that kept the step from compiling most often (samples):", *op_tables(report, "step")]
    return "\n".join(lines)


def op_tables(report: dict, path: str) -> list[str]:
    """``path``'s most common fallbacks, then its row per op (status, sample counts, error, note)."""
    lines = ["", "| fallback op | why | samples |", "|---|---|---|"]
    lines += [f"| `{op}` | {_cell(why)} | {n} |" for (op, why), n in fallback_counts(report, path).most_common(20)]
    status = "status" if path == "backend" else f"{path} status"
    lines += ["", f"| op | {status} | dtype | " + " | ".join(STATUSES) + " | max abs error | note |",
              "|---|---|---|" + "---|" * len(STATUSES) + "---|---|"]
    for name in sorted(report["ops"]):
        entry = report["ops"][name]
        counts = collections.Counter(of_path(s, path)["status"] for s in entry["samples"])
        lines.append(f"| {name} | {of_path(entry, path)['status']} | {entry['dtype'] or ''} | "
                     + " | ".join(str(counts[s]) for s in STATUSES)
                     + f" | {_error(entry, path)} | {note(entry, path)} |")
    return lines
