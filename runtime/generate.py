"""``LanguageModel``: a generation bundle (``lm_bundle``) on a device, generating token ids with no torch.

``lm = load(path)`` (``model.load`` recognises a generation bundle), then ``lm.generate(prompt_ids,
max_new_tokens)`` returns the prompt and the new ids as one int64 array; ``lm.stream(...)`` yields the new ids one
by one. The weights go up once, shared by the prefill and decode programs, and the KV cache lives in device arrays
that both bind: a decode step uploads a few numbers (the token, its position, the sampler's) and reads back one
token id. Greedy (``temperature=0``) and temperature sampling choose on the device; ``top_k`` / ``top_p`` read the
last row's scores back and sample on the host. ``seed`` makes sampling repeat (the device's random numbers are keyed
by it too).

A prompt runs through prefill in chunks of the bundle's ``prefill_tokens``; the last chunk is the last
``prefill_tokens`` tokens of the prompt (its earlier ones are written again with the same keys and values), or, for a
shorter prompt, the prompt padded at its end: the padding's cache slots lie after the prompt, unread until the
decode steps write them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .device import Device
from .errors import InputError
from .lm_bundle import LMBundle, cache_name
from .program import Program
from .requirements import check_requirements
from .resident import DedicatedBuffers, DeviceArray

_INT32 = np.iinfo(np.int32)


@dataclass
class GenerationStats:
    """Times of the last ``generate`` / ``stream``: prefill (the prompt) and decode (each new token after the
    first), in seconds."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: list = field(default_factory=list)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return len(self.decode_steps) / self.decode_seconds if self.decode_seconds else 0.0


class _Phase:
    """One phase's program, with its plan names for the manifest's inputs and outputs."""

    def __init__(self, device: Device, bundle, cache_names: list[str], weight_buffers: dict):
        manifest = bundle.manifest
        self.inputs = {e["name"]: e["plan_name"] for e in manifest["inputs"]}
        self.outputs = {e["name"]: e["plan_name"] for e in manifest["outputs"]}
        self.rng_input = manifest["rng_input"]
        cache_inputs = [self.inputs[n] for n in cache_names]
        resident = [self.outputs["scores"]] + [self.outputs[n] for n in cache_names]
        self.program = Program(device, bundle.plan, resident_outputs=resident, device_only_inputs=cache_inputs)
        source = {e["plan_name"]: e["source"] for e in manifest["params"]}
        self.program.bind_params({t.buffer: weight_buffers[source[t.name]] for t in bundle.plan.params})
        self.length = next(e["shape"][1] for e in manifest["inputs"] if e["name"] == "input_ids")


class LanguageModel:
    """A generation bundle instantiated on ``device`` (see the module docstring)."""

    def __init__(self, bundle: LMBundle, device: Device):
        for phase in bundle.phases.values():  # before any device object is built
            check_requirements(phase.manifest["requires"], device.features, device.limits, device.describe())
        self.path, self.manifest, self.device = bundle.path, bundle.manifest, device
        self.max_cache_len = bundle.manifest["max_cache_len"]
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
        self._cache = {name: DeviceArray(device.pool, tuple(e["shape"]), e["dtype"])
                       for name, e in zip(self._cache_names, bundle.cache)}
        self.stats = GenerationStats()
        self._rng = np.random.default_rng()

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, eos_token_id=None) -> np.ndarray:
        """The prompt followed by up to ``max_new_tokens`` new ids (fewer where an end-of-sequence id comes: the
        bundle's, or ``eos_token_id``), as an int64 array of shape [n]."""
        prompt = _prompt(prompt_ids)
        new = list(self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id))
        return np.concatenate([prompt, np.asarray(new, dtype=np.int64)])

    def stream(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, eos_token_id=None):
        """An iterator of the new token ids, one by one (``generate``'s arguments, checked now)."""
        prompt = _prompt(prompt_ids)
        sampler = _Sampler(temperature, top_k, top_p, self.vocab_size)
        self._check_length(len(prompt), max_new_tokens)
        stops = set(self.eos_token_ids if eos_token_id is None else np.atleast_1d(eos_token_id).tolist())
        return self._tokens(prompt, max_new_tokens, sampler, stops, seed)

    def _tokens(self, prompt: np.ndarray, max_new_tokens: int, sampler: "_Sampler", stops: set, seed):
        self._rng = np.random.default_rng(seed)
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        start = time.perf_counter()
        token = self._prefill(prompt, sampler)
        self.stats.prefill_seconds = time.perf_counter() - start
        position = len(prompt)
        for n in range(max_new_tokens):
            self.stats.new_tokens += 1
            yield token
            if token in stops or n + 1 == max_new_tokens:
                return
            began = time.perf_counter()
            token = self._run("decode", np.array([[token]]), position, 0, sampler)
            self.stats.decode_steps.append(time.perf_counter() - began)
            self.stats.decode_seconds += self.stats.decode_steps[-1]
            position += 1

    def _check_length(self, prompt: int, max_new_tokens: int) -> None:
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if prompt + max_new_tokens > self.max_cache_len:
            raise InputError(f"a prompt of {prompt} tokens and {max_new_tokens} new ones need "
                             f"{prompt + max_new_tokens} "
                             f"cache positions; this bundle holds {self.max_cache_len} (export_lm's max_cache_len)")

    def _prefill(self, prompt: np.ndarray, sampler: "_Sampler") -> int:
        """Run the prompt through prefill in chunks; return the first new token."""
        chunk = self._phases["prefill"].length
        start = 0
        while start + chunk < len(prompt):
            self._run("prefill", prompt[None, start:start + chunk], start, chunk - 1, sampler)
            start += chunk
        if len(prompt) >= chunk:
            return self._run("prefill", prompt[None, -chunk:], len(prompt) - chunk, chunk - 1, sampler)
        padded = np.zeros((1, chunk), dtype=np.int64)
        padded[0, :len(prompt)] = prompt
        return self._run("prefill", padded, 0, len(prompt) - 1, sampler)

    def _run(self, phase_name: str, ids: np.ndarray, start: int, last: int, sampler: "_Sampler") -> int:
        """One run of a phase at cache positions ``start``...; returns the token it chose (or the host sampler's)."""
        phase = self._phases[phase_name]
        length = ids.shape[1]
        feed = {phase.inputs["input_ids"]: ids.astype(np.int64),
                phase.inputs["cache_position"]: np.arange(start, start + length, dtype=np.int64),
                phase.inputs["last"]: np.array([last], dtype=np.int64),
                phase.inputs["temperature"]: np.array([sampler.device_temperature], dtype=np.float32),
                phase.inputs["sampling"]: np.array([sampler.device_sampling], dtype=np.float32)}
        if phase.rng_input:
            feed[phase.rng_input] = self._rng.integers(_INT32.min, _INT32.max, size=2, dtype=np.int32, endpoint=True)
        cache = {phase.inputs[n]: self._cache[n] for n in self._cache_names}
        results = phase.program.run(feed, device_inputs=cache)
        for n in self._cache_names:  # an output stored over its input is that array; another is the new one
            new = results[phase.outputs[n]]
            if new is not self._cache[n]:
                self._cache[n].release()
                self._cache[n] = new
        scores = results[phase.outputs["scores"]]
        if sampler.on_host:
            token = sampler.sample(scores.numpy().reshape(-1), self._rng)
        else:
            token = int(np.asarray(results[phase.outputs["token"]]).reshape(-1)[0])
        scores.release()
        return token

    def release(self) -> None:
        """Free the device memory of this model; it cannot generate afterwards."""
        for phase in self._phases.values():
            phase.program.release()
        for array in [*self._weights.values(), *self._cache.values()]:
            array.release()

    def __repr__(self) -> str:
        return (f"<meganeura LanguageModel {self.path} ({self.max_cache_len} positions, vocabulary {self.vocab_size}) "
                f"on {self.device.describe()}>")


def _prompt(prompt_ids) -> np.ndarray:
    prompt = np.asarray(prompt_ids)
    if prompt.ndim == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise InputError(f"prompt_ids must be a non-empty 1-D array of token ids (or [1, n]), got "
                         f"{prompt.dtype} of shape {prompt.shape}")
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
