"""What dynamo needs to capture ordinary user code whole: logging calls that would otherwise break the graph.

Dynamo refuses ``logging.Logger`` methods outside ``torch.export`` (``Unsupported: logging.Logger method not
supported``), and HF code calls them on ordinary paths: ``logger.warning_once`` in GPT-2's ``labels=`` loss. Under
``quiet_logging_for_dynamo()`` every logging method of ``logging.Logger`` (the standard ones and those libraries
add to the class, such as transformers' ``warning_once``) is a no-op inside the captured code, as torch.export
makes them: a message logged inside a captured step is not emitted. A capture is first tried as it is
(``compile_quieting_logging_if_refused``).
"""
from __future__ import annotations

import contextlib
import logging

import torch

STANDARD_LOG_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")
# Methods libraries add to logging.Logger by name: transformers' warning_once, info_once, warning_advice
ADDED_LOG_METHOD_PREFIXES = ("warning_", "info_", "debug_", "error_")


def logger_methods() -> set:
    """The logging methods of ``logging.Logger`` as they are now (libraries add theirs when imported)."""
    names = set(STANDARD_LOG_METHODS)
    names.update(n for n in vars(logging.Logger) if n.startswith(ADDED_LOG_METHOD_PREFIXES))
    return {getattr(logging.Logger, n) for n in names if callable(getattr(logging.Logger, n, None))}


@contextlib.contextmanager
def quiet_logging_for_dynamo():
    """Dynamo treats logging calls as no-ops inside this block instead of breaking the graph on them."""
    ignored = set(torch._dynamo.config.ignore_logging_functions) | logger_methods()
    with torch._dynamo.config.patch(ignore_logging_functions=ignored):
        yield


def compile_quieting_logging_if_refused(run) -> None:
    """``run()`` (a dynamo capture); where dynamo refuses a logging call, ``run()`` again with logging calls as
    no-ops. (Only then: torch 2.11 logs an error when it records a config holding functions.)"""
    try:
        run()
        return
    except torch._dynamo.exc.Unsupported as err:
        if "logging" not in str(err):
            raise
    with quiet_logging_for_dynamo():
        run()


# What tracing a whole step (dynamo's fullgraph capture, then make_fx over torch.func) cannot do, though the backend
# runs the same loss: a graph break or data-dependent guard in dynamo, a data-dependent guard in make_fx (prod's
# backward over zeros), an autograd.Function without setup_context under torch.func, a fake tensor whose data an
# op reads (tensor_split's index tensor). compile_train_step then runs the loss through the backend instead.
CAPTURE_LIMIT_TYPES = (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError,
                       torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode)
CAPTURE_LIMIT_MESSAGES = ("autograd.Function with functorch transforms", "data is not allocated yet")


def is_capture_limit(err: BaseException) -> bool:
    """Whether ``err`` says the whole step cannot be traced as one graph (not that something is wrong)."""
    return isinstance(err, CAPTURE_LIMIT_TYPES) or (
        isinstance(err, RuntimeError) and any(m in str(err) for m in CAPTURE_LIMIT_MESSAGES))
