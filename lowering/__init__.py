"""Torch-free compiler middle: typed static IR, fusion into archetype kernels, memory planning, the plan.

``compile_graph(graph, limits)`` runs the passes in order: keep_requested_regions (regions.py) -> fit_bindings (the
nodes lowering made wider than the adapter's storage-buffer limit brought within it) -> rematerialize (far readers of
cheap pointwise values get copies to inline instead of the value kept: remat.py) -> fuse (inline producers into
consumers) -> eliminate_common_nodes (repeats dropped before their siblings merge them: a decode step's cache writes
then share one index lookup) -> fuse_sibling_reductions (row programs over the same rows into one) -> fuse_epilogues
(consumers into reductions and matmuls) -> fuse_multi_output (a pointwise value with several readers stored by its
first pointwise reader) -> eliminate_common_nodes (a kernel that repeats an earlier one is dropped: after fusion, so
that a repeated cheap producer still inlines into each of its consumers) -> fuse_sibling_matmuls (products that share
an operand side by side in one matmul) -> fuse_paired_matmuls (a one-row product that another's epilogue reads computed
in that one's kernel: paired_matmuls.py) -> fuse_row_prologues (a one-row normalisation into the matrix-vector products
that read it: row_prologues.py) -> fuse_sibling_updates (pointwise nodes of one shape whose outputs are all graph
outputs, a layer's key and value cache writes, in one kernel: sibling_updates.py) -> fuse_sibling_pointwise (pointwise
nodes of one shape that read a value at the same index, SiLU's stored input and its backward's sigmoid, in one kernel:
sibling_pointwise.py) -> separate_checks (the data checks from the first in-place update on run first, in kernels of
their own, those that read only inputs together at the front, and the index arithmetic they leave unchecked inlined
into its readers: data_checks.py) -> hoist_writers
(in-place updates moved up to just after their last dependency: in_place.py) -> run_over_regions (an update stored over
its input, a KV cache's, computes only the elements it changes: regions.py) -> fuse_attention_writes (a cache update
that an attention pass reads stored by that pass's dispatch, the pass reading the update's expressions, and where the
binding limit asks, several outputs of one node that it reads side by side, bound once: attention_writes.py,
packed.py) -> schedule (memory plan + WGSL + dispatches; a decode attention's slices merged by the projection that
reads them: slice_merges.py). ``fuse_graph`` and ``schedule_fused`` are its two halves: a dynamic graph keeps the
fused one and schedules it again for a call past its bounds.

A dynamic graph's sizes are ``meganeura.kernels.sizes.Size``s, compiled under its ``Guards``; its kernels read the
symbols' values from the plan's size buffer, a uniform in a bind group of its own (``kernels.wgsl.SIZES_VAR``).

Modules: ``ir`` (the typed static graph and its archetype nodes), ``expr`` (scalar expression trees, the kernels'
bodies), ``builder`` (``GraphBuilder``: the vocabulary op lowerings add nodes with), ``indexing`` (coordinate loads
to linear reads, i32 simplification), ``bindings`` (each kernel within the adapter's storage-binding limit),
``remat``, ``fusion`` (producers inlined into consumers, refusals with reasons), ``siblings`` with
``sibling_reductions`` and ``sibling_matmuls`` (sibling nodes merged), ``paired_matmuls``, ``row_prologues``,
``sibling_updates``, ``sibling_pointwise``, ``attention_writes`` (a cache update run by the attention that reads it),
``packed`` (a node's outputs side by side in the arena, bound once by a kernel that reads several), ``epilogues``,
``multi_output``, ``cse`` (repeated kernels dropped), ``in_place`` (outputs written over an input's buffer),
``data_checks`` (checks run before any input is overwritten), ``regions`` (updates run over the elements they
change), ``planner`` (intermediates placed in one arena by lifetime), ``schedule`` (a
fused graph to a ``Plan``: memory plan, WGSL, dispatches) with ``node_kernels`` (each node's kernels, by archetype),
``slice_merges`` (an attention pass's slices merged by the matrix-vector product that reads its output, in place of
a merge dispatch), ``plan_cache`` (compiled plans kept on disk across processes).
"""
from __future__ import annotations

from dataclasses import dataclass

from meganeura.runtime.plan import Plan

from .attention_writes import fuse_attention_writes
from .bindings import fit_bindings
from .cse import eliminate_common_nodes
from .epilogues import fuse_epilogues
from .fusion import FusionReport, fuse
from .data_checks import separate_checks
from .in_place import hoist_writers
from .ir import Graph
from .multi_output import fuse_multi_output
from .paired_matmuls import fuse_paired_matmuls
from .regions import keep_requested_regions, run_over_regions
from .remat import rematerialize
from .row_prologues import fuse_row_prologues
from .schedule import schedule
from .sibling_matmuls import fuse_sibling_matmuls
from .sibling_pointwise import fuse_sibling_pointwise
from .sibling_reductions import fuse_sibling_reductions
from .sibling_updates import fuse_sibling_updates


@dataclass
class FusedGraph:
    """A graph after the fusion passes, ready to schedule, with its report and the passes' counts. A dynamic graph's
    compile keeps it, so that the plan for sizes past its bounds is scheduled again from it (``schedule_fused``)
    rather than lowered and fused again."""

    graph: Graph
    report: FusionReport
    stats: dict


def compile_graph(graph: Graph, limits: dict, choose_matmuls=None, on_kernel=None):
    """Fuse and schedule ``graph``; return (Plan, FusionReport). ``choose_matmuls`` picks tiled matmul variants and
    ``on_kernel`` hears of each kernel as it is generated (see ``schedule``)."""
    fused = fuse_graph(graph, limits)
    return schedule_fused(fused, limits, choose_matmuls, on_kernel), fused.report


def fuse_graph(graph: Graph, limits: dict) -> FusedGraph:
    """The fusion passes over ``graph``, in place, in the order the module docstring gives."""
    max_bindings = limits.get("max-storage-buffers-per-shader-stage", 8)
    keep_requested_regions(graph)
    fit_bindings(graph, max_bindings)
    copies = rematerialize(graph)
    report = fuse(graph, max_bindings)
    common = eliminate_common_nodes(graph)  # (before siblings merge: repeated reductions would merge, not drop)
    fuse_sibling_reductions(graph, max_bindings, report)
    fuse_epilogues(graph, max_bindings, report)
    fuse_multi_output(graph, max_bindings, report)
    common += eliminate_common_nodes(graph)
    fuse_sibling_matmuls(graph, max_bindings, report)
    fuse_paired_matmuls(graph, max_bindings, report)
    fuse_row_prologues(graph, max_bindings, report)
    fuse_sibling_updates(graph, max_bindings, report)
    fuse_sibling_pointwise(graph, max_bindings, report)
    separated = separate_checks(graph, max_bindings, report)
    hoisted = hoist_writers(graph)
    whole_updates = run_over_regions(graph)
    attention_writes = fuse_attention_writes(graph, max_bindings, report)
    return FusedGraph(graph, report, {"fused_producers": len(report.fused), "common_nodes": common,
                                      "hoisted_writers": hoisted, "rematerialized": copies,
                                      "separated_checks": separated, "whole_updates": whole_updates,
                                      "attention_writes": attention_writes})


def schedule_fused(fused: FusedGraph, limits: dict, choose_matmuls=None, on_kernel=None) -> Plan:
    """``fused``'s plan (``schedule``), which leaves the fused graph as it was: a dynamic graph schedules it again
    for larger bounds."""
    return schedule(fused.graph, limits, stats=fused.stats, choose_matmuls=choose_matmuls, on_kernel=on_kernel)
