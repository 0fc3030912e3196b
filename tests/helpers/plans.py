"""Hand-built plans of small elementwise kernels, for tests of ``Program`` on a real or a recording device."""
from __future__ import annotations

from meganeura.runtime.plan import Binding, BufferSpec, Dispatch, Plan, TensorSpec


def kernel(params: list[tuple[str, str]], body: str) -> str:
    """WGSL of a 1-D elementwise kernel over ``out``; params are (name, element type), bound in order."""
    lines = [
        f"@group(0) @binding({i}) var<storage, read_write> {name}: array<{ty}>;" for i, (name, ty) in enumerate(params)
    ]
    lines.append("@compute @workgroup_size(64)")
    lines.append("fn main(@builtin(global_invocation_id) gid: vec3<u32>) {")
    lines.append("  let i = gid.x;")
    lines.append("  if (i >= arrayLength(&out)) { return; }")
    lines.append(f"  {body}")
    lines.append("}")
    return "\n".join(lines)


def align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def groups(n: int) -> tuple[int, int, int]:
    return (max(1, (n + 63) // 64), 1, 1)


ADD = kernel([("a", "f32"), ("b", "f32"), ("out", "f32")], "out[i] = a[i] + b[i];")
DOUBLE = kernel([("src", "f32"), ("out", "f32")], "out[i] = 2.0 * src[i];")


def add_plan(n: int = 100) -> Plan:
    """out = a + b, with a and b packed into one input buffer at aligned offsets."""
    nb, off = 4 * n, align(4 * n)
    return Plan(
        buffers=[BufferSpec("inputs", off + nb, "input"), BufferSpec("out", nb, "output")],
        inputs=[TensorSpec("a", "inputs", 0, (n,), "float32"), TensorSpec("b", "inputs", off, (n,), "float32")],
        params=[],
        outputs=[TensorSpec("sum", "out", 0, (n,), "float32")],
        kernels={"add": ADD},
        dispatches=[
            Dispatch(
                "add", (Binding("inputs", 0, nb), Binding("inputs", off, nb), Binding("out", 0, nb)), groups(n), "add"
            )
        ],
    )


def affine_plan(n: int = 64) -> Plan:
    """y = x * w + bias, with w and bias in one param buffer."""
    nb, off = 4 * n, align(4 * n)
    body = kernel([("x", "f32"), ("w", "f32"), ("bias", "f32"), ("out", "f32")], "out[i] = x[i] * w[i] + bias[i];")
    return Plan(
        buffers=[BufferSpec("x", nb, "input"), BufferSpec("weights", off + nb, "param"), BufferSpec("y", nb, "output")],
        inputs=[TensorSpec("x", "x", 0, (n,), "float32")],
        params=[TensorSpec("w", "weights", 0, (n,), "float32"), TensorSpec("bias", "weights", off, (n,), "float32")],
        outputs=[TensorSpec("y", "y", 0, (n,), "float32")],
        kernels={"affine": body},
        dispatches=[
            Dispatch(
                "affine",
                (Binding("x", 0, nb), Binding("weights", 0, nb), Binding("weights", off, nb), Binding("y", 0, nb)),
                groups(n),
            )
        ],
    )


def arena_chain_plan(n: int = 40) -> Plan:
    """Three dispatches of one kernel through two arena tensors: out = 8 x."""
    nb, off = 4 * n, align(4 * n)
    return Plan(
        buffers=[BufferSpec("x", nb, "input"), BufferSpec("arena", off + nb, "arena"), BufferSpec("y", nb, "output")],
        inputs=[TensorSpec("x", "x", 0, (n,), "float32")],
        params=[],
        outputs=[TensorSpec("y", "y", 0, (n,), "float32")],
        kernels={"double": DOUBLE},
        dispatches=[
            Dispatch("double", (Binding("x", 0, nb), Binding("arena", 0, nb)), groups(n), "t0"),
            Dispatch("double", (Binding("arena", 0, nb), Binding("arena", off, nb)), groups(n), "t1"),
            Dispatch("double", (Binding("arena", off, nb), Binding("y", 0, nb)), groups(n), "t2"),
        ],
    )


def affine_arena_plan(n: int = 40) -> Plan:
    """y = 2 (x * w + bias), through one arena tensor; w and bias in one param buffer."""
    nb, off = 4 * n, align(4 * n)
    affine = kernel([("x", "f32"), ("w", "f32"), ("bias", "f32"), ("out", "f32")], "out[i] = x[i] * w[i] + bias[i];")
    return Plan(
        buffers=[BufferSpec("x", nb, "input"), BufferSpec("weights", off + nb, "param"),
                 BufferSpec("arena", nb, "arena"), BufferSpec("y", nb, "output")],
        inputs=[TensorSpec("x", "x", 0, (n,), "float32")],
        params=[TensorSpec("w", "weights", 0, (n,), "float32"), TensorSpec("bias", "weights", off, (n,), "float32")],
        outputs=[TensorSpec("y", "y", 0, (n,), "float32")],
        kernels={"affine": affine, "double": DOUBLE},
        dispatches=[
            Dispatch("affine", (Binding("x", 0, nb), Binding("weights", 0, nb), Binding("weights", off, nb),
                                Binding("arena", 0, nb)), groups(n), "t0"),
            Dispatch("double", (Binding("arena", 0, nb), Binding("y", 0, nb)), groups(n), "t1"),
        ],
    )


def chain_plan(n: int, steps: int) -> Plan:
    """``steps`` dependent dispatches: out = a, then out = 2 out + a, so out = a (2^steps - 1)."""
    init = kernel([("a", "f32"), ("out", "f32")], "out[i] = a[i];")
    double_add = kernel([("a", "f32"), ("out", "f32")], "out[i] = out[i] * 2.0 + a[i];")
    bindings = (Binding("a", 0, 4 * n), Binding("out", 0, 4 * n))
    return Plan(
        buffers=[BufferSpec("a", 4 * n, "input"), BufferSpec("out", 4 * n, "output")],
        inputs=[TensorSpec("a", "a", 0, (n,), "float32")], params=[],
        outputs=[TensorSpec("out", "out", 0, (n,), "float32")],
        kernels={"init": init, "double_add": double_add},
        dispatches=[Dispatch("init", bindings, groups(n), "init")]
        + [Dispatch("double_add", bindings, groups(n), f"step {k}") for k in range(1, steps)],
    )


GATHER = """
@group(0) @binding(0) var<storage, read_write> table: array<f32>;
@group(0) @binding(1) var<storage, read_write> idx: array<i32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read_write> status: array<atomic<u32>>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= arrayLength(&out)) { return; }
  let j = idx[i];
  if (j < 0 || u32(j) >= arrayLength(&table)) {
    atomicMax(&status[0], CODE);
    out[i] = 0.0;
    return;
  }
  out[i] = table[j];
}
"""


def gather_plan(code: int, n: int = 20, rows: int = 8) -> Plan:
    """out = table[idx]; an index out of range raises status ``code`` (its message: index out of range in
    embedding) and gives 0."""
    return Plan(
        buffers=[
            BufferSpec("table", 4 * rows, "input"),
            BufferSpec("idx", 4 * n, "input"),
            BufferSpec("out", 4 * n, "output"),
            BufferSpec("status", 4, "status"),
        ],
        inputs=[TensorSpec("table", "table", 0, (rows,), "float32"), TensorSpec("idx", "idx", 0, (n,), "int64")],
        params=[],
        outputs=[TensorSpec("out", "out", 0, (n,), "float32")],
        kernels={"gather": GATHER.replace("CODE", f"{code}u")},
        dispatches=[
            Dispatch(
                "gather",
                (
                    Binding("table", 0, 4 * rows),
                    Binding("idx", 0, 4 * n),
                    Binding("out", 0, 4 * n),
                    Binding("status", 0, 4),
                ),
                groups(n),
                "embedding",
            )
        ],
        status_messages={1: "index out of range in embedding"},
    )


def no_output_plan() -> Plan:
    """One dispatch from an input into the arena, and no output to read back."""
    return Plan(
        buffers=[BufferSpec("x", 64, "input"), BufferSpec("arena", 64, "arena")],
        inputs=[TensorSpec("x", "x", 0, (16,), "float32")],
        params=[],
        outputs=[],
        kernels={"double": DOUBLE},
        dispatches=[Dispatch("double", (Binding("x", 0, 64), Binding("arena", 0, 64)), (1, 1, 1))],
    )
