"""``LanguageModel``: a generation bundle (``lm_bundle``) on a device, generating token ids with no torch.

``lm = load(path)`` (``model.load`` recognises a generation bundle), then ``lm.generate(prompt_ids,
max_new_tokens)`` returns the prompt and the new ids as one int64 array; ``lm.stream(...)`` yields the new ids one
by one. The weights go up once, shared by the prefill and decode programs, and the KV cache lives in device arrays
that both bind: a decode step uploads a few numbers (the tokens' position, the sampler's) and reads back the token
ids. Greedy (``temperature=0``) and temperature sampling choose on the device, and a decode step takes the
step before's token ids on the device too, so the host submits a few steps ahead of reading their tokens
(``meganeura.runtime.run_ahead``; ``run_ahead = 1``, or ``MEGANEURA_SYNC=1``, reads each step before the next);
``top_k`` / ``top_p`` read the last column's scores back and sample on the host, a step at a time. ``seed`` makes
sampling repeat (the device's random numbers are keyed by it too).

A prompt runs through prefill in chunks of the bundle's ``prefill_tokens``; the last chunk is the last
``prefill_tokens`` tokens of the prompt (its earlier ones are written again with the same keys and values), or, for a
shorter prompt, the prompt padded at its end: the padding's cache slots lie after the prompt, unread until the
decode steps write them.

Batches: a bundle exported with ``batch_size=B`` generates for up to B prompts of any lengths together:
``generate([prompt, ...], max_new_tokens)`` returns one array per prompt, and ``stream`` yields, per step, a list
with each prompt's new id (None once that prompt has ended). The prompts are left-padded to the longest one, so that
every row's prompt ends at the same cache slot and every row's new token goes to the same slot; ``prompt_start``
tells the plans where each row's own tokens begin, and the model masks the padding out and counts each row's
positions from its first token (``torch_meganeura.bundles.lm_export``): each row's tokens are the ones it would get
alone. A row stops at its own end-of-sequence id; it is fed its last token again until the others end (its slot in
the batch costs the same either way) and its outputs are dropped. A batch smaller than B is filled with one-token
rows whose outputs are dropped.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from .device import Device
from .errors import InputError
from .lm_bundle import PADDING_INPUT, LMBundle, cache_name
from .in_flight import LaterRead
from .program import Program
from .requirements import check_requirements
from .resident import DedicatedBuffers, DeviceArray
from .run_ahead import RUN_AHEAD, RunAhead

_INT32 = np.iinfo(np.int32)
FILLER_TOKEN = 0  # the id of left padding and of the one-token rows that fill a batch: masked out or dropped


@dataclass
class GenerationStats:
    """Times of the last ``generate`` / ``stream``, in seconds: prefill (the prompts, until their first tokens are on
    the host) and decode (the host's time in the steps after the first: submitting them and waiting for their
    tokens, not the caller's between tokens); token counts over every prompt of a batch (its filler rows and ended
    rows not counted). ``decode_steps`` has an entry per decode step whose tokens were taken: with steps run ahead
    (``run_ahead``), the seconds of the call that read its tokens, shared evenly with the steps read together, so
    the entries sum to ``decode_seconds``; steps submitted past the last token taken have none."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    decode_tokens: int = 0  # new tokens that decode steps made (all but each prompt's first)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: list = field(default_factory=list)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class _Phase:
    """One phase's program, with its plan names for the manifest's inputs and outputs."""

    def __init__(self, device: Device, bundle, cache_names: list[str], weight_buffers: dict):
        manifest = bundle.manifest
        self.inputs = {e["name"]: e["plan_name"] for e in manifest["inputs"]}
        self.outputs = {e["name"]: e["plan_name"] for e in manifest["outputs"]}
        self.rng_input = manifest["rng_input"]
        cache_inputs = [self.inputs[n] for n in cache_names]
        self.token = self.outputs["token"]
        resident = [self.token, self.outputs["scores"]] + [self.outputs[n] for n in cache_names]
        self.program = Program(device, bundle.plan, resident_outputs=resident, device_only_inputs=cache_inputs)
        # the token ids come back in the run's staging buffer (at most READ_ALONG_BYTES: 16 rows), else downloaded
        self.read_later = (self.token,) if self.token in self.program.readable_along else ()
        source = {e["plan_name"]: e["source"] for e in manifest["params"]}
        self.program.bind_params({t.buffer: weight_buffers[source[t.name]] for t in bundle.plan.params})
        self.length = next(e["shape"][1] for e in manifest["inputs"] if e["name"] == "input_ids")
        self.prompt_start = self.inputs.get(PADDING_INPUT)


class LanguageModel:
    """A generation bundle instantiated on ``device`` (see the module docstring)."""

    def __init__(self, bundle: LMBundle, device: Device):
        for phase in bundle.phases.values():  # before any device object is built
            check_requirements(phase.manifest["requires"], device.features, device.limits, device.describe())
        self.path, self.manifest, self.device = bundle.path, bundle.manifest, device
        self.max_cache_len = bundle.manifest["max_cache_len"]
        self.batch_size = bundle.manifest["batch_size"]
        self.vocab_size = bundle.manifest["vocab_size"]
        self.eos_token_ids = list(bundle.manifest["eos_token_ids"])
        self._buffers = DedicatedBuffers(device, "weight")
        entries = {e["name"]: e["dtype"] for e in bundle.manifest["weights"]}
        self._weights = {name: DeviceArray.upload(device, array, entries[name], self._buffers)
                         for name, array in bundle.weights.items()}
        buffers = {name: array.buffer for name, array in self._weights.items()}
        self._cache_names = [cache_name(i) for i in range(len(bundle.cache))]
        self._phases = {name: _Phase(device, phase, self._cache_names, buffers)
                        for name, phase in bundle.phases.items()}
        for phase in self._phases.values():
            phase.program.wait_pipelines()
        # zeros, as HF's StaticCache starts: attention weighs the positions past a sequence by exactly 0, and 0 times
        # what an earlier user of a pool buffer left there (another model's values, NaN as this dtype) is NaN
        self._cache = {name: DeviceArray.zeros(device, tuple(e["shape"]), e["dtype"])
                       for name, e in zip(self._cache_names, bundle.cache)}
        self.stats = GenerationStats()
        self._rng = np.random.default_rng()
        # decode steps submitted and unread (``run_ahead``); 1: each step's tokens are read before the next goes
        self.run_ahead = 1 if device.in_flight.sync else RUN_AHEAD

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, eos_token_id=None):
        """The prompt followed by up to ``max_new_tokens`` new ids (fewer where an end-of-sequence id comes: the
        bundle's, or ``eos_token_id``), as an int64 array of shape [n]. Given a list of prompts (at most the
        bundle's ``batch_size``), a list of such arrays, one per prompt, each ending at its own end-of-sequence id."""
        if _is_batch(prompt_ids):
            prompts = self._prompts(prompt_ids)
            new = [[] for _ in prompts]
            for step in self.stream(prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id):
                for row, token in zip(new, step):
                    if token is not None:
                        row.append(token)
            return [np.concatenate([p, np.asarray(n, dtype=np.int64)]) for p, n in zip(prompts, new)]
        prompt = _prompt(prompt_ids)
        new = list(self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id))
        return np.concatenate([prompt, np.asarray(new, dtype=np.int64)])

    def stream(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, eos_token_id=None):
        """An iterator of the new token ids, one by one (``generate``'s arguments, checked now); given a list of
        prompts, of lists with each prompt's new id, None for a prompt that has ended."""
        batch = _is_batch(prompt_ids)
        prompts = self._prompts(prompt_ids) if batch else [_prompt(prompt_ids)]
        sampler = _Sampler(temperature, top_k, top_p, self.vocab_size)
        self._check_length(max(len(p) for p in prompts), max_new_tokens)
        stops = self.eos_token_ids if eos_token_id is None else np.atleast_1d(eos_token_id).tolist()
        steps = self._tokens(prompts, max_new_tokens, sampler, set(stops), seed)
        return steps if batch else (step[0] for step in steps)

    def _prompts(self, prompts) -> list[np.ndarray]:
        """A batch's prompts, checked: at most the bundle's batch size, each a non-empty 1-D array of ids."""
        if len(prompts) > self.batch_size:
            raise InputError(f"{len(prompts)} prompts: this bundle generates for at most {self.batch_size} together "
                             f"(export_lm's batch_size)")
        checked = []
        for k, prompt in enumerate(prompts):
            try:
                checked.append(_prompt(prompt))
            except InputError as err:
                raise InputError(f"prompt {k}: {err}") from None
        return checked

    def _tokens(self, prompts: list[np.ndarray], max_new_tokens: int, sampler: "_Sampler", stops: set, seed):
        """Each step's new ids of ``prompts`` (a list, None where a prompt has ended)."""
        self._rng = np.random.default_rng(seed)
        rows = _LeftPadded(prompts, self.batch_size)
        self.stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
        start = time.perf_counter()
        tokens = self._prefill(rows, sampler)
        self.stats.prefill_seconds = time.perf_counter() - start
        live = [True] * len(prompts)
        steps = self._decode_steps(tokens, max_new_tokens - 1, sampler, rows)
        for n in range(max_new_tokens):
            step = [int(t) if alive else None for t, alive in zip(tokens, live)]
            self.stats.new_tokens += sum(live)
            yield step
            live = [alive and token not in stops for token, alive in zip(step, live)]
            if not any(live) or n + 1 == max_new_tokens:
                return
            tokens, seconds = steps.next()
            self.stats.decode_steps.append(seconds)
            self.stats.decode_seconds += seconds
            self.stats.decode_tokens += sum(live)

    def _decode_steps(self, first: np.ndarray, steps: int, sampler: "_Sampler", rows: "_LeftPadded"):
        """The tokens of up to ``steps`` decode steps after the prefill's ``first``, by ``next()``: submitted ahead
        (``run_ahead``) where the device chooses them and reads them back along, else one step at a time."""
        phase, positions = self._phases["decode"], itertools.count(rows.length)

        def read_each(ids):  # a host sampler's step, or a batch too wide to read back along
            tokens = self._run("decode", _as_ids(ids), next(positions), 0, sampler, rows.starts)
            return tokens, LaterRead.done({phase.token: tokens})

        def submit(ids):
            results = self._submit("decode", _as_ids(ids), next(positions), 0, sampler, rows.starts)
            results[phase.outputs["scores"]].release()
            return results[phase.token], phase.program.later

        if sampler.on_host or not phase.read_later:
            return RunAhead(read_each, first, steps, phase.token, ahead=1)
        return RunAhead(submit, first, steps, phase.token, self.run_ahead)

    def _check_length(self, prompt: int, max_new_tokens: int) -> None:
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if prompt + max_new_tokens > self.max_cache_len:
            raise InputError(f"a prompt of {prompt} tokens and {max_new_tokens} new ones need "
                             f"{prompt + max_new_tokens} "
                             f"cache positions; this bundle holds {self.max_cache_len} (export_lm's max_cache_len)")

    def _prefill(self, rows: "_LeftPadded", sampler: "_Sampler") -> np.ndarray:
        """Run the prompts through prefill in chunks; return each row's first new token."""
        chunk, ids = self._phases["prefill"].length, rows.ids
        start = 0
        while start + chunk < rows.length:  # (its tokens are not read)
            self._submit("prefill", ids[:, start:start + chunk], start, chunk - 1, sampler, rows.starts)
            start += chunk
        if rows.length >= chunk:
            return self._run("prefill", ids[:, -chunk:], rows.length - chunk, chunk - 1, sampler, rows.starts)
        padded = np.full((len(ids), chunk), FILLER_TOKEN, dtype=np.int64)
        padded[:, :rows.length] = ids
        return self._run("prefill", padded, 0, rows.length - 1, sampler, rows.starts)

    def _run(self, phase_name: str, ids: np.ndarray, start: int, last: int, sampler: "_Sampler",
             prompt_starts: np.ndarray) -> np.ndarray:
        """One run of a phase at cache positions ``start``... (``_submit``); returns the token each row chose (or
        the host sampler's), read back now."""
        phase = self._phases[phase_name]
        results = self._submit(phase_name, ids, start, last, sampler, prompt_starts)
        scores, token = results[phase.outputs["scores"]], results[phase.token]
        if sampler.on_host:
            tokens = np.array([sampler.sample(row, self._rng) for row in scores.numpy().reshape(len(ids), -1)])
        elif phase.read_later:
            tokens = phase.program.later.values()[phase.token].reshape(-1).astype(np.int64)
        else:
            tokens = token.numpy().reshape(-1).astype(np.int64)
        scores.release()
        token.release()
        return tokens

    def _submit(self, phase_name: str, ids, start: int, last: int, sampler: "_Sampler",
                prompt_starts: np.ndarray) -> dict:
        """Submit one run of a phase at cache positions ``start``... over ``ids`` [batch, length] (host ids, or a
        device array: a decode step's, the token output of the step before); returns its outputs (the token ids and
        scores as device arrays), the cache's updated in ``_cache``."""
        phase = self._phases[phase_name]
        length = ids.shape[1]
        on_device = isinstance(ids, DeviceArray)
        feed = {} if on_device else {phase.inputs["input_ids"]: ids.astype(np.int64)}
        feed |= {phase.inputs["cache_position"]: np.arange(start, start + length, dtype=np.int64),
                phase.inputs["last"]: np.array([last], dtype=np.int64),
                phase.inputs["temperature"]: np.array([sampler.device_temperature], dtype=np.float32),
                phase.inputs["sampling"]: np.array([sampler.device_sampling], dtype=np.float32)}
        if phase.prompt_start is not None:
            feed[phase.prompt_start] = prompt_starts
        if phase.rng_input:
            feed[phase.rng_input] = self._rng.integers(_INT32.min, _INT32.max, size=2, dtype=np.int32, endpoint=True)
        device_inputs = {phase.inputs[n]: self._cache[n] for n in self._cache_names}
        if on_device:
            device_inputs[phase.inputs["input_ids"]] = ids
        results = phase.program.run(feed, device_inputs=device_inputs, read_later=phase.read_later)
        for n in self._cache_names:  # an output stored over its input is that array; another is the new one
            new = results[phase.outputs[n]]
            if new is not self._cache[n]:
                self._cache[n].release()
                self._cache[n] = new
        return results

    def release(self) -> None:
        """Free the device memory of this model; it cannot generate afterwards."""
        for phase in self._phases.values():
            phase.program.release()
        for array in [*self._weights.values(), *self._cache.values()]:
            array.release()

    def __repr__(self) -> str:
        batch = f", batches of {self.batch_size}" if self.batch_size > 1 else ""
        return (f"<meganeura LanguageModel {self.path} ({self.max_cache_len} positions{batch}, vocabulary "
                f"{self.vocab_size}) on {self.device.describe()}>")


class _LeftPadded:
    """Prompts as the bundle's rows: ``ids`` [batch, length], each prompt at the end of its row after
    FILLER_TOKEN padding, ``starts`` [batch] where each row's own tokens begin; rows past the prompts hold one
    filler token."""

    def __init__(self, prompts: list[np.ndarray], batch: int):
        self.length = max(len(p) for p in prompts)
        self.ids = np.full((batch, self.length), FILLER_TOKEN, dtype=np.int64)
        lengths = [len(p) for p in prompts] + [1] * (batch - len(prompts))
        self.starts = self.length - np.asarray(lengths, dtype=np.int64)
        for row, prompt in enumerate(prompts):
            self.ids[row, self.starts[row]:] = prompt


def _as_ids(tokens):
    """A step's tokens [batch] (host or device) as the next step's ids [batch, 1]."""
    return tokens.reshaped((tokens.shape[0], 1)) if isinstance(tokens, DeviceArray) else tokens[:, None]


def _is_batch(prompt_ids) -> bool:
    """A list or tuple of prompts (each a sequence of ids), as opposed to one prompt."""
    return isinstance(prompt_ids, (list, tuple)) and any(np.ndim(p) > 0 for p in prompt_ids)


def _prompt(prompt_ids) -> np.ndarray:
    prompt = np.asarray(prompt_ids)
    if prompt.ndim == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise InputError(f"prompt_ids must be a non-empty 1-D array of token ids (or [1, n]; several prompts: a "
                         f"list of them), got {prompt.dtype} of shape {prompt.shape}")
    return prompt.astype(np.int64)


class _Sampler:
    """How the next token is chosen: greedy or with a temperature on the device (the plans' Gumbel-max), top-k / top-p
    on the host from the scores (logits over the temperature)."""

    def __init__(self, temperature: float, top_k: int | None, top_p: float | None, vocab_size: int):
        if temperature < 0:
            raise InputError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and not 1 <= top_k <= vocab_size:
            raise InputError(f"top_k must lie in 1..{vocab_size}, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise InputError(f"top_p must lie in (0, 1], got {top_p}")
        self.on_host = temperature > 0 and (top_k is not None or top_p is not None)
        self.top_k, self.top_p = top_k, top_p
        self.device_temperature = temperature if temperature > 0 else 1.0
        self.device_sampling = 1.0 if temperature > 0 and not self.on_host else 0.0

    def sample(self, scores: np.ndarray, rng: np.random.Generator) -> int:
        scores = scores.astype(np.float64)
        if self.top_k is not None:
            kth = np.partition(scores, -self.top_k)[-self.top_k]
            scores = np.where(scores < kth, -np.inf, scores)
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        if self.top_p is not None:
            order = np.argsort(-probs, kind="stable")
            keep = np.cumsum(probs[order]) - probs[order] < self.top_p  # the smallest set reaching top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return int(rng.choice(len(probs), p=probs))
