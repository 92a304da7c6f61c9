"""Delta weight sync without Ray (``rltrainer.weights.delta``): a delta applied to an engine (one that
lends its tensors, one the decoder keeps a mirror for) leaves it byte-equal to the sender's tensors
after every step of random sparse changes, for bf16, fp32 and a bucket mixing dtypes; each bucket
falls back to full bytes by itself; the checksum sees one changed word and two swapped ones; a
corrupted engine fails the check, and the gate keeps requests off it until the repair has loaded."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from rltrainer.testing.fake_device import DeviceTensor, FakeDevice
from rltrainer.weights import _kernels, delta
from rltrainer.weights.delta import BLOCK_WORDS, DeltaDecoder, DeltaEncoder, DeltaSync, checksum
from rltrainer.weights.receiver import WeightReceiver
from rltrainer.weights.staging import EngineGate
from rltrainer.weights.wire import Bucket, Entry, bucket_entries


class LendingEngine:
    """Holds its weights whole under their names and lends them (as ``HFEngine.weight_tensors``):
    a delta is written into them in place."""

    native_weight_broadcast = False

    def __init__(self) -> None:
        self.weight_version = -1
        self.weights: dict[str, torch.Tensor] = {}
        self.updates: list[list[str]] = []

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, weights) -> dict[str, float]:
        weights = list(weights)
        self.updates.append([name for name, _ in weights])
        for name, tensor in weights:
            if name in self.weights:
                self.weights[name].copy_(tensor)
            else:
                self.weights[name] = tensor.clone()
        return {}

    def weight_tensors(self, names):
        if not all(name in self.weights for name in names):
            return None
        return {name: self.weights[name] for name in names}


class MirrorEngine(LendingEngine):
    """Lends nothing (as vLLM, whose layers are fused and sharded): the decoder keeps a mirror and
    loads each touched tensor through ``update_weights``."""

    weight_tensors = None


def make_tensors(dtypes: dict[str, torch.dtype], seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, dtype) in enumerate(dtypes.items()):
        shape = (37 + 11 * i, 5 + i)  # odd sizes: entries start at odd word offsets
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=generator).to(dtype)
        else:
            out[name] = torch.randint(0, 100, shape, generator=generator, dtype=dtype)
    return out


def entries_of(tensors: dict[str, torch.Tensor]) -> list[Entry]:
    return bucket_entries((name, tuple(t.shape), t.dtype) for name, t in tensors.items())


def perturb(tensors: dict[str, torch.Tensor], share: float, generator: torch.Generator) -> None:
    """Change about ``share`` of the elements of every tensor (some may keep their bytes)."""
    for tensor in tensors.values():
        flat = tensor.view(-1)
        picked = torch.rand(flat.numel(), generator=generator) < share
        if tensor.dtype.is_floating_point:
            step = torch.randn(int(picked.sum()), generator=generator).to(tensor.dtype)
            flat[picked] = flat[picked] + step
        else:
            flat[picked] = torch.randint(0, 100, (int(picked.sum()),), generator=generator, dtype=tensor.dtype)


def assert_bytes_equal(engine: LendingEngine, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        held = engine.weights[name]
        assert held.dtype == tensor.dtype and held.shape == tensor.shape, name
        assert torch.equal(held.view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def sides(tensors: dict[str, torch.Tensor], engine_type: type | None = None, settings: DeltaSync | None = None):
    """A bucket of ``tensors``: its entries, the sender's encoder (deltas up to half a bucket: these change many
    words of small tensors), a decoder and an engine."""
    engine = (engine_type or LendingEngine)()
    return entries_of(tensors), DeltaEncoder(settings or DeltaSync(max_share=0.5)), DeltaDecoder(), engine


def sync(encoder: DeltaEncoder, decoder: DeltaDecoder, engine: LendingEngine, tensors: dict[str, torch.Tensor],
         entries: list[Entry]):
    encoder.begin_sync(())
    payload, encoding = encoder.encode(tensors, entries)
    assert payload.dtype == torch.uint8 and payload.numel() == encoding.nbytes
    assert decoder.apply(engine, payload, entries, encoding)
    return encoding


@pytest.fixture(params=["compiled", "reference"])
def codec(request, monkeypatch):
    """Each codec test runs on both codecs: the compiled one-pass kernels (numba, the CPU default)
    and the whole-array reference passes (a GPU's, or without numba)."""
    if request.param == "compiled":
        if _kernels.kernels() is None:
            pytest.fail("numba is a dependency of rltrainer; the compiled codec must be tested")
    else:
        monkeypatch.setattr(_kernels, "ENABLED", False)
    return request.param


DTYPE_CASES = {
    "bf16": {"a": torch.bfloat16, "b": torch.bfloat16},
    "fp32": {"a": torch.float32, "b": torch.float32},
    "mixed": {"f32": torch.float32, "bf16": torch.bfloat16, "u8": torch.uint8, "f16": torch.float16},
}


@pytest.mark.parametrize("engine_type", [LendingEngine, MirrorEngine])
@pytest.mark.parametrize("case", list(DTYPE_CASES))
def test_random_sparse_changes_round_trip_byte_equal_at_every_step(case, engine_type, codec):
    tensors = make_tensors(DTYPE_CASES[case])
    entries, encoder, decoder, engine = sides(tensors, engine_type)
    generator = torch.Generator().manual_seed(1)
    first = sync(encoder, decoder, engine, tensors, entries)
    assert first.kind == "full" and first.nbytes == first.full_nbytes  # no base yet
    assert_bytes_equal(engine, tensors)
    word = 1 if case == "mixed" else tensors["a"].element_size()
    kinds = []
    for share in (0.01, 0.05, 0.0, 0.02, 0.9, 0.01, 0.01, 0.01):
        perturb(tensors, share, generator)
        encoding = sync(encoder, decoder, engine, tensors, entries)
        kinds.append(encoding.kind)
        assert encoding.word == word and encoding.words == encoding.full_nbytes // word
        if encoding.kind == "delta":
            assert encoding.nbytes < encoding.full_nbytes * 0.5
        assert_bytes_equal(engine, tensors)
        assert len(encoding.checksums) == (len(entries) if encoding.kind == "delta" else 0)  # full: a plain copy
    # 90 % changed: full, then it backs off (full twice, the second taking a new base), then deltas again
    assert kinds == ["delta", "delta", "delta", "delta", "full", "full", "full", "delta"]
    if engine_type is MirrorEngine:  # the mirror is one engine-dtype copy
        assert decoder.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    else:
        assert decoder.nbytes == 0
    assert encoder.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("engine_type", [LendingEngine, MirrorEngine])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_a_bucket_of_several_index_blocks_round_trips(dtype, engine_type, codec):
    """Indices travel as 16-bit offsets within 65,536-word blocks: changes on both sides of each
    block's edges and of the offsets' sign bit, in a bucket of two tensors spanning four blocks."""
    generator = torch.Generator().manual_seed(3)
    tensors = {"big": torch.randint(0, 100, (3 * BLOCK_WORDS + 123,), generator=generator).to(dtype),
               "small": torch.randint(0, 100, (70_001,), generator=generator).to(dtype)}
    entries, encoder, decoder, engine = sides(tensors, engine_type)
    sync(encoder, decoder, engine, tensors, entries)
    edges = [0, 1, (1 << 15) - 1, 1 << 15, BLOCK_WORDS - 1, BLOCK_WORDS, BLOCK_WORDS + (1 << 15),
             2 * BLOCK_WORDS - 1, 3 * BLOCK_WORDS, 3 * BLOCK_WORDS + 122]
    for step in range(3):
        flat = tensors["big"].view(-1)
        picked = torch.unique(torch.cat([torch.tensor(edges[step::2] if step < 2 else edges),
                                         torch.randint(0, flat.numel(), (500,), generator=generator)]))
        flat.view(torch.uint8 if dtype == torch.uint8 else torch.int16)[picked] ^= 1
        tensors["small"].view(-1)[torch.randint(0, 70_001, (50,), generator=generator)] += 1
        encoding = sync(encoder, decoder, engine, tensors, entries)
        assert encoding.kind == "delta" and encoding.words > 4 * BLOCK_WORDS
        assert_bytes_equal(engine, tensors)


def test_bytes_not_values_signed_zero_and_nan_payloads_travel():
    """The scan compares words, so a change that compares equal as a float still travels."""
    tensors = {"w": torch.zeros(64, dtype=torch.bfloat16), "v": torch.full((8,), float("nan"))}
    entries, encoder, decoder, engine = sides(tensors)
    sync(encoder, decoder, engine, tensors, entries)
    tensors["w"][3] = -0.0
    tensors["v"].view(torch.int32)[5] += 1  # another NaN
    encoding = sync(encoder, decoder, engine, tensors, entries)
    assert encoding.kind == "delta" and encoding.changed == 2  # 2-byte words: -0.0, and the low half of the NaN
    assert_bytes_equal(engine, tensors)


def test_an_unchanged_bucket_is_an_empty_delta_and_a_mirror_engine_loads_nothing():
    tensors = make_tensors(DTYPE_CASES["bf16"])
    entries, encoder, decoder, engine = sides(tensors, MirrorEngine)
    sync(encoder, decoder, engine, tensors, entries)
    encoding = sync(encoder, decoder, engine, tensors, entries)
    assert encoding.kind == "delta" and encoding.changed == 0 and encoding.nbytes <= 8  # a count per block, no value
    assert engine.updates == [["a", "b"]]  # the first (full) sync only
    tensors["b"].view(-1)[0] += 1
    sync(encoder, decoder, engine, tensors, entries)
    assert engine.updates[-1] == ["a", "b"]  # a touched bucket is loaded whole (vLLM rebuilds fused layers)
    assert_bytes_equal(engine, tensors)


def test_a_bucket_falls_back_to_full_above_max_share(codec):
    tensors = {"w": torch.arange(1000, dtype=torch.float32).to(torch.bfloat16)}
    entries = entries_of(tensors)
    for max_share, kind in ((0.5, "full"), (1.0, "delta")):
        encoder, decoder, engine = DeltaEncoder(DeltaSync(max_share=max_share)), DeltaDecoder(), LendingEngine()
        sync(encoder, decoder, engine, {"w": tensors["w"].clone()}, entries)
        changed = tensors["w"].clone()
        changed.view(torch.int16)[:400] ^= 1  # 40 % of the words; 3 bytes per 2-byte word (step, offset): 60 %
        encoding = sync(encoder, decoder, engine, {"w": changed}, entries)
        assert encoding.kind == kind
        # a delta counts every change; a scan that finds too many stops (past max_share / 3 bytes a word)
        assert encoding.changed == 400 if kind == "delta" else 1000 * max_share * 2 / 3 - 10 < encoding.changed <= 400
        assert (encoding.nbytes == encoding.full_nbytes) == (kind == "full")
        assert_bytes_equal(engine, {"w": changed})


def test_a_name_without_a_base_sends_its_bucket_in_full():
    tensors = make_tensors(DTYPE_CASES["bf16"])
    encoder, decoder, engine = DeltaEncoder(DeltaSync()), DeltaDecoder(), LendingEngine()
    sync(encoder, decoder, engine, {"a": tensors["a"]}, entries_of({"a": tensors["a"]}))
    both = sync(encoder, decoder, engine, tensors, entries_of(tensors))  # "b" is new: the bucket goes whole
    assert both.kind == "full"
    assert sync(encoder, decoder, engine, tensors, entries_of(tensors)).kind == "delta"  # now both have a base


def test_fresh_names_and_forget_send_full_buckets():
    tensors = make_tensors(DTYPE_CASES["bf16"])
    bucket_a, bucket_b = entries_of({"a": tensors["a"]}), entries_of({"b": tensors["b"]})
    encoder, decoder, engine = DeltaEncoder(DeltaSync()), DeltaDecoder(), LendingEngine()

    def kinds(fresh=()):
        encoder.begin_sync(fresh)
        out = []
        for entries in (bucket_a, bucket_b):
            payload, encoding = encoder.encode(tensors, entries)
            assert decoder.apply(engine, payload, entries, encoding)
            out.append(encoding.kind)
        return out

    assert kinds() == ["full", "full"]
    assert kinds() == ["delta", "delta"]
    assert kinds(fresh=["b"]) == ["delta", "full"]  # e.g. never synced, or a woken engine's dropped weights
    encoder.forget()
    assert encoder.nbytes == 0
    assert kinds() == ["full", "full"]
    assert_bytes_equal(engine, tensors)


def test_checksum_every_k_syncs():
    tensors = make_tensors(DTYPE_CASES["bf16"])
    entries, encoder, decoder, engine = sides(tensors, None, DeltaSync(checksum_every=2))
    verified = [bool(sync(encoder, decoder, engine, tensors, entries).checksums) for _ in range(5)]
    assert verified == [False, False, True, False, True]  # the first sync is full: a plain copy carries none
    never = DeltaEncoder(DeltaSync(checksum_every=0))
    never.begin_sync(())
    assert never.encode(tensors, entries)[1].checksums == ()


# -- the checksum --------------------------------------------------------------------------------------
def test_checksum_of_equal_bytes_on_a_misaligned_view():
    generator = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3 * 8 * 1024 + 13,), generator=generator, dtype=torch.uint8)  # rows and a tail
    view = raw[1:]  # not 8-byte aligned
    assert view.data_ptr() % 8
    assert checksum(view) == checksum(view.clone())
    values = torch.randn(5000, generator=generator).to(torch.bfloat16)
    assert values[1:].data_ptr() % 8
    assert checksum(values[1:]) == checksum(values[1:].clone()) == checksum(values[1:].view(torch.int16))
    assert checksum(values[:-1]) != checksum(values[1:])


@pytest.mark.parametrize("where", ["rows", "tail", "last_byte"])
def test_checksum_changes_with_one_word(where):
    raw = torch.randint(0, 256, (2 * 8 * 1024 + 8 * 7 + 3,), generator=torch.Generator().manual_seed(1),
                        dtype=torch.uint8)
    position = {"rows": 8 * 1500 + 3, "tail": 2 * 8 * 1024 + 8 * 4 + 1, "last_byte": raw.numel() - 1}[where]
    changed = raw.clone()
    changed[position] ^= 1
    assert checksum(changed) != checksum(raw)


@pytest.mark.parametrize("pair", [(3, 900), (5, 1024 + 5), (10, 1024 + 700), (2048 + 1, 2048 + 3), (7, 2048 + 2)],
                         ids=["same-row", "same-column", "other-row-and-column", "tail", "rows-and-tail"])
def test_checksum_changes_when_two_words_swap(pair):
    words = torch.randint(-2**62, 2**62, (2048 + 6,), generator=torch.Generator().manual_seed(2), dtype=torch.int64)
    i, j = pair
    swapped = words.clone()
    swapped[i], swapped[j] = words[j], words[i]
    assert not torch.equal(swapped, words)
    assert checksum(swapped) != checksum(words)
    assert checksum(swapped.view(torch.bfloat16)) != checksum(words.view(torch.bfloat16))


# -- a corrupted engine ---------------------------------------------------------------------------------
def test_a_corrupted_lent_tensor_fails_the_check():
    tensors = make_tensors(DTYPE_CASES["bf16"])
    entries, encoder, decoder, engine = sides(tensors)
    sync(encoder, decoder, engine, tensors, entries)
    engine.weights["b"].view(-1)[7] += 1  # the engine's own weights drifted from what the sender holds
    tensors["a"].view(-1)[0] += 1
    encoder.begin_sync(())
    payload, encoding = encoder.encode(tensors, entries)
    assert encoding.kind == "delta"
    assert not decoder.apply(engine, payload, entries, encoding)
    full, repair = encoder.full(entries)  # the repair: the bucket again in full from the base
    assert decoder.apply(engine, full, entries, repair)
    assert_bytes_equal(engine, tensors)


def test_a_corrupted_mirror_fails_the_check_and_a_delta_without_one_too():
    tensors = make_tensors(DTYPE_CASES["fp32"])
    entries, encoder, decoder, engine = sides(tensors, MirrorEngine)
    sync(encoder, decoder, engine, tensors, entries)
    decoder.mirror["a"][11] ^= 1  # the copy the engine's loads are built from
    tensors["b"].view(-1)[0] += 1
    encoder.begin_sync(())
    payload, encoding = encoder.encode(tensors, entries)
    assert encoding.kind == "delta"
    assert not decoder.apply(engine, payload, entries, encoding)
    assert not DeltaDecoder().apply(MirrorEngine(), payload, entries, encoding)  # a new replica holds nothing
    full, repair = encoder.full(entries)  # the repair loads the bucket whole and refreshes the mirror
    assert decoder.apply(engine, full, entries, repair)
    assert_bytes_equal(engine, tensors)
    for name, tensor in tensors.items():
        assert torch.equal(decoder.mirror[name], tensor.reshape(-1).view(torch.int32)), name


# -- the gate: a mismatched sync keeps its version and requests wait for the repair ---------------------
class GateCase:
    """A lending engine behind a gate and its receiver, with the sender's encoder."""

    def __init__(self) -> None:
        self.tensors = make_tensors(DTYPE_CASES["bf16"])
        self.entries = entries_of(self.tensors)
        self.gate, self.engine, self.encoder = EngineGate(), LendingEngine(), DeltaEncoder(DeltaSync())
        self.receiver = WeightReceiver(torch.device("cpu"), self.gate)

    def coded(self) -> Bucket:
        """The next sync's bucket, as the sender codes it."""
        self.encoder.begin_sync(())
        payload, encoding = self.encoder.encode(self.tensors, self.entries)
        return Bucket(self.entries, payload.numpy(), encoding)

    def full(self, checksums: tuple[int, ...] | None = None) -> Bucket:
        """The bucket again in full from the base (a repair), with other ``checksums`` if given."""
        payload, encoding = self.encoder.full(self.entries)
        if checksums is not None:
            encoding = dataclasses.replace(encoding, checksums=checksums)
        return Bucket(self.entries, payload.numpy(), encoding)

    def drift(self) -> None:
        """The engine's weights drift from what the sender holds, and the policy moves."""
        self.engine.weights["a"].view(-1)[0] += 1
        self.tensors["b"].view(-1)[3] += 1

    def request(self, min_version: int) -> tuple[threading.Thread, threading.Event, dict]:
        """A request in a thread: ``entered`` once it holds the engine; ``seen``: the version and
        weights it saw, or the error it raised."""
        entered, seen = threading.Event(), {}

        def run():
            try:
                with self.gate.use(self.engine, min_version):
                    entered.set()
                    seen["version"] = self.engine.weight_version
                    seen["bytes"] = {name: t.clone() for name, t in self.engine.weights.items()}
            except RuntimeError as exc:
                seen["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread, entered, seen


def test_a_mismatched_sync_keeps_the_version_and_requests_wait_for_the_repair():
    case = GateCase()
    stats = case.receiver.load(case.engine, case.coded(), 1, 0, 1)
    assert stats["mismatched"] == [] and case.engine.weight_version == 1
    case.drift()
    stats = case.receiver.load(case.engine, case.coded(), 2, 0, 1)
    assert stats["mismatched"] == [0] and stats["delta_buckets"] == 1
    assert case.engine.weight_version == 1  # not the sync's: the engine does not hold it
    thread, entered, seen = case.request(2)
    assert not entered.wait(0.3)  # the sync waits for its repair
    assert case.receiver.repair(case.engine, [case.full()], 2)["tensors"] == len(case.entries)
    thread.join(10)
    assert entered.is_set() and seen["version"] == 2 and case.engine.weight_version == 2
    for name, tensor in case.tensors.items():
        assert torch.equal(seen["bytes"][name], tensor), name


def test_a_request_waiting_when_the_sync_lands_applies_it_then_waits_for_the_repair():
    """The request applies the complete sync itself, finds the mismatch, and waits for the repair."""
    case = GateCase()
    case.receiver.load(case.engine, case.coded(), 1, 0, 1)
    case.drift()
    coded = case.coded()
    thread, entered, seen = case.request(2)  # waits for version 2 to arrive
    stats = case.receiver.load(case.engine, coded, 2, 0, 1)
    assert stats["mismatched"] == [0] and case.engine.weight_version == 1
    assert not entered.wait(0.3)
    case.receiver.repair(case.engine, [case.full()], 2)
    thread.join(10)
    assert entered.is_set() and seen["version"] == 2
    assert_bytes_equal(case.engine, case.tensors)


def test_a_repair_that_still_mismatches_stops_the_engine():
    case = GateCase()
    case.receiver.load(case.engine, case.coded(), 1, 0, 1)
    with pytest.raises(RuntimeError, match="still do not match"):
        case.receiver.repair(case.engine, [case.full(checksums=(1, 2))], 2)
    with pytest.raises(RuntimeError, match="Loading weight sync 2 into this engine failed"):
        with case.gate.use(case.engine, -1):
            pass


def test_a_request_waiting_for_a_repair_that_fails_raises():
    case = GateCase()
    case.receiver.load(case.engine, case.coded(), 1, 0, 1)
    case.drift()
    assert case.receiver.load(case.engine, case.coded(), 2, 0, 1)["mismatched"] == [0]
    thread, entered, seen = case.request(2)
    with pytest.raises(RuntimeError, match="still do not match"):
        case.receiver.repair(case.engine, [case.full(checksums=(1, 2))], 2)
    thread.join(10)
    assert not thread.is_alive(), "the request still waits for a repair that failed"
    assert not entered.is_set() and "Loading weight sync 2 into this engine failed" in str(seen["error"])


def test_an_engine_that_receives_broadcasts_itself_refuses_a_delta():
    class Native(LendingEngine):
        native_weight_broadcast = True

    tensors = make_tensors(DTYPE_CASES["bf16"])
    entries = entries_of(tensors)
    encoder = DeltaEncoder(DeltaSync())
    encoder.begin_sync(())
    encoder.encode(tensors, entries)
    encoder.begin_sync(())
    payload, encoding = encoder.encode(tensors, entries)
    assert encoding.kind == "delta"
    receiver = WeightReceiver(torch.device("cpu"), EngineGate())
    with pytest.raises(RuntimeError, match=r"Native receives broadcast buckets itself.*Rollout\(delta=False\)"):
        receiver.load(Native(), Bucket(entries, payload.numpy(), encoding), 1, 0, 1)


# -- settings --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [({"max_share": 0}, "max_share must be a number > 0 and <= 1 .*got 0"),
                                           ({"max_share": 1.5}, "max_share must be .*got 1.5"),
                                           ({"max_share": -0.1}, r"> 0 and <= 1 \(a share of the bucket's bytes\)"),
                                           ({"checksum_every": -1}, "checksum_every must be an int >= 0.*got -1"),
                                           ({"checksum_every": 2.5}, "an int >= 0")])
def test_delta_sync_settings_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeltaSync(**kwargs)


def test_delta_values():
    assert DeltaSync.resolve(True) == DeltaSync() and DeltaSync.resolve(False) is None
    assert DeltaSync.resolve(None) is None
    settings = DeltaSync(max_share=0.25, checksum_every=4)
    assert DeltaSync.resolve(settings) is settings
    with pytest.raises(TypeError, match=r"delta='yes'; pass True, False or DeltaSync"):
        DeltaSync.resolve("yes")


def test_a_rollout_checks_delta():
    from rltrainer.rollout.rollout import Rollout

    assert Rollout(placement="split", delta=True).delta == DeltaSync()
    with pytest.raises(TypeError, match="delta='yes'"):
        Rollout(placement="split", delta="yes")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_steps_past_an_int8_travel_by_value(dtype, codec):
    """A word whose bit pattern moved by more than 127 (a large update, a sign change; every word of an
    8-byte dtype) goes as an escape, by value; small steps as int8: both land exactly."""
    tensors = {"w": torch.linspace(-1, 1, 5000, dtype=torch.float32).to(dtype)}
    entries = entries_of(tensors)
    encoder, decoder, engine = DeltaEncoder(DeltaSync()), DeltaDecoder(), LendingEngine()
    sync(encoder, decoder, engine, {"w": tensors["w"].clone()}, entries)
    changed = tensors["w"].clone()
    changed[:40] = -changed[:40]  # sign flips: far past an int8 step
    words = changed.view(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[changed.element_size()])
    words[100:140] += 1  # one ulp up
    words[200:240] -= 3
    encoding = sync(encoder, decoder, engine, {"w": changed}, entries)
    assert encoding.kind == "delta" and encoding.changed == 120
    assert encoding.escapes == (120 if dtype == torch.float64 else 40)
    assert_bytes_equal(engine, {"w": changed})


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8])
@pytest.mark.parametrize("share", [0.0, 0.001, 0.03, 0.2])
def test_the_compiled_codec_writes_the_reference_bytes(dtype, share, parts, monkeypatch):
    """The compiled kernels (one pass; a large bucket cut into ``parts`` at block edges, one thread
    each, tensors cut mid-way and unaligned) and the reference (whole-array passes) write the same
    payload for the same bucket, and apply it to the same bytes: random changes of every size
    (escapes included), tensors of odd lengths (words past the last 32-byte group), several blocks."""
    monkeypatch.setattr(delta, "PARALLEL_WORDS", BLOCK_WORDS if parts > 1 else 1 << 40)
    monkeypatch.setattr(torch, "get_num_threads", lambda: parts)
    generator = torch.Generator().manual_seed(int(share * 1000) + dtype.itemsize)

    def bucket():
        return {"a": (torch.randn(BLOCK_WORDS + 4097, generator=generator) * 3).to(dtype),
                "b": (torch.randn(77, 13, generator=generator) * 3).to(dtype),
                "c": (torch.randn(2 * BLOCK_WORDS + 5, generator=generator) * 3).to(dtype)}

    tensors = bucket()
    entries = entries_of(tensors)
    encoders = {"compiled": DeltaEncoder(DeltaSync(max_share=1.0)), "reference": DeltaEncoder(DeltaSync(max_share=1.0))}
    engines = {name: LendingEngine() for name in encoders}
    for step in range(3):
        payloads = {}
        for name, encoder in encoders.items():
            monkeypatch.setattr(_kernels, "ENABLED", name == "compiled")
            encoder.begin_sync(())
            payloads[name] = encoder.encode({n: t.clone() for n, t in tensors.items()}, entries)
            assert DeltaDecoder().apply(engines[name], *(payloads[name][0], entries, payloads[name][1]))
            assert_bytes_equal(engines[name], tensors)
        (compiled, c_encoding), (reference, r_encoding) = payloads["compiled"], payloads["reference"]
        assert c_encoding.kind == r_encoding.kind
        assert c_encoding.kind == ("full" if step == 0 else "delta") or share > 0.1  # many escapes: full
        assert (c_encoding.changed, c_encoding.escapes, c_encoding.checksums) == (
            r_encoding.changed, r_encoding.escapes, r_encoding.checksums)
        assert torch.equal(compiled, reference)
        fresh = bucket()
        for name, tensor in tensors.items():  # about `share` of the words move: half a step or two, half far
            words = tensor.view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
                tensor.element_size()])
            draw = torch.rand(tensor.numel(), generator=generator)
            words[draw < share / 2] += torch.randint(1, 3, (int((draw < share / 2).sum()),), generator=generator,
                                                     dtype=words.dtype)
            far = (draw >= share / 2) & (draw < share)
            tensor.view(-1)[far] = fresh[name].view(-1)[far]


@pytest.mark.parametrize("codec_name", ["compiled", "reference"])
def test_a_bucket_that_keeps_changing_backs_off_and_is_scanned_again(codec_name, monkeypatch):
    """A bucket with too many changes stops its scan, goes in full and drops its base; it then goes in
    full for 2 syncs (the first unscanned, the second taking a new base) and is scanned again; each
    failure doubles the wait (up to 16 syncs); a delta resets it. Every sync leaves the engine exact."""
    monkeypatch.setattr(_kernels, "ENABLED", codec_name == "compiled")
    tensors = {"w": torch.randn(50_000).to(torch.bfloat16)}
    entries, encoder, decoder, engine = sides(tensors, settings=DeltaSync(max_share=0.1))
    sync(encoder, decoder, engine, tensors, entries)
    generator = torch.Generator().manual_seed(0)
    seen = []
    for share in [0.5] * 9 + [0.001] * 9 + [0.5] + [0.001] * 3:
        perturb(tensors, share, generator)
        encoding = sync(encoder, decoder, engine, tensors, entries)
        assert_bytes_equal(engine, tensors)
        if encoding.kind == "delta":
            seen.append("delta")
        elif not encoding.scanned:
            seen.append("skip")
        elif "w" in encoder.base:
            seen.append("rebase")  # no base: taken whole (as on a first sync)
        else:  # too many: it dropped the base (the compiled scan stops as soon as it knows)
            assert encoding.scanned < encoding.words or codec_name == "reference"
            seen.append("scan")
    # a failed scan waits 2 syncs, then 4, 8 (up to 16); the last of them takes a new base; a delta resets it
    assert seen == (["scan", "skip", "rebase", "scan"] + ["skip"] * 3 + ["rebase", "scan"] + ["skip"] * 7
                    + ["rebase", "delta", "scan", "skip", "rebase", "delta"])
    assert encoder.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("early_stop", [1.5, 1e9])
def test_the_compiled_scan_stops_after_the_round_past_the_budget(monkeypatch, early_stop):
    """Chunks are scanned a round at a time (one per thread), the first round spread over the
    bucket; the scan stops after the round in which the bucket's changes pass the budget, or after
    the first if its share projects ``EARLY_STOP`` budgets."""
    monkeypatch.setattr(delta, "EARLY_STOP", early_stop)
    monkeypatch.setattr(delta, "PARALLEL_WORDS", BLOCK_WORDS)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    tensors = {"w": torch.zeros(8 * BLOCK_WORDS, dtype=torch.bfloat16)}
    entries = entries_of(tensors)
    encoder = DeltaEncoder(DeltaSync(max_share=(9 * 1000 + 48) / (16 * BLOCK_WORDS)))  # a budget of 3,000 words
    encoder.begin_sync(())
    encoder.encode(tensors, entries)
    words = tensors["w"].view(-1).view(torch.int16)
    for block in range(8):  # 1,000 changes in each block: no chunk alone passes the budget
        words[block * BLOCK_WORDS:block * BLOCK_WORDS + 1000] += 1
    encoder.begin_sync(())
    payload, encoding = encoder.encode(tensors, entries)
    assert encoding.kind == "full" and "w" not in encoder.base
    if early_stop < 8000 / 3000:  # the first round (blocks 0 and 4) projects 8,000 changes
        assert (encoding.scanned, encoding.changed) == (2 * BLOCK_WORDS, 2000)
    else:
        assert (encoding.scanned, encoding.changed) == (4 * BLOCK_WORDS, 4000)  # two rounds of two chunks


def test_a_bucket_whose_changes_sit_outside_the_sample_is_still_a_delta(monkeypatch):
    """The first round's sample projects no changes; the rest of the scan finds them, a delta."""
    monkeypatch.setattr(delta, "PARALLEL_WORDS", BLOCK_WORDS)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    tensors = {"w": torch.zeros(8 * BLOCK_WORDS, dtype=torch.bfloat16)}
    budget_3000 = DeltaSync(max_share=(9 * 1000 + 48) / (16 * BLOCK_WORDS))
    entries, encoder, decoder, engine = sides(tensors, settings=budget_3000)
    sync(encoder, decoder, engine, tensors, entries)
    tensors["w"].view(-1).view(torch.int16)[3 * BLOCK_WORDS:3 * BLOCK_WORDS + 2500] += 1  # block 3: not sampled
    encoding = sync(encoder, decoder, engine, tensors, entries)
    assert encoding.kind == "delta" and encoding.changed == 2500 and encoding.scanned == 8 * BLOCK_WORDS
    assert_bytes_equal(engine, tensors)


# -- an engine that keeps a tensor in another dtype than the wire's (as the vLLM CPU build or a router in fp32) -
class WideningEngine(LendingEngine):
    """Lends its tensors, as the ``hf`` engine does, but keeps ``wide`` in fp32 while the wire is
    bf16 (as transformers keeps DeepSeek-V3's router ``gate.weight`` in a bf16 model): that name
    cannot take a delta in place and goes through the mirror."""

    def __init__(self, wide: str) -> None:
        super().__init__()
        self.wide = wide

    def update_weights(self, weights) -> dict[str, float]:
        super().update_weights((name, tensor.float() if name == self.wide else tensor) for name, tensor in weights)
        return {}


def test_an_engine_keeping_one_tensor_wider_lends_the_others_and_no_mirror_goes_stale(codec):
    """The wide tensor alone is mirrored; a name lent in one sync and mirrored with the wide one in the next
    (buckets follow what changed) still gets the right delta: it was a bucket-wide choice, so a name
    lent once kept a stale mirror that a later delta was applied to."""
    tensors = {"a": torch.randn(64, 8).to(torch.bfloat16), "wide": torch.randn(32, 8).to(torch.bfloat16)}
    both, alone = entries_of(tensors), entries_of({"a": tensors["a"]})
    encoder, decoder, engine = DeltaEncoder(DeltaSync(max_share=0.5)), DeltaDecoder(), WideningEngine("wide")
    generator = torch.Generator().manual_seed(3)
    for step, entries in enumerate([both, alone, both, alone, both]):
        names = [name for name, _, _ in entries]
        if step:
            perturb({n: tensors[n] for n in names}, 0.05, generator)
        encoding = sync(encoder, decoder, engine, tensors, entries)  # asserts the checksums match
        assert encoding.kind == ("full" if step == 0 else "delta"), step
        assert torch.equal(engine.weights["a"], tensors["a"])
        assert engine.weights["wide"].dtype == torch.float32 and torch.equal(engine.weights["wide"], tensors["wide"].float())
        assert set(decoder.mirror) == {"wide"}  # the lent tensor is not copied


# -- where the copies live when the weights are on a device (imitated: rltrainer.testing.fake_device) --------
def on_device(device: FakeDevice, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: device.tensor(t) for name, t in tensors.items()}


@pytest.mark.parametrize("copies", ["host", "device"])
def test_the_base_and_the_mirror_live_where_copies_says_when_the_weights_are_on_a_device(copies):
    """A GPU trainer's gathers and a GPU receiver's payloads: with ``copies="host"`` (the default) the
    base and the mirror are host tensors and the codec keeps nothing on the device (vLLM sized itself
    to its share of the GPU); with ``"device"`` they are on the device, and its torch passes (a GPU's
    codec) give the same engine weights."""
    settings = DeltaSync(max_share=0.5, copies=copies)
    tensors = make_tensors(DTYPE_CASES["mixed"])
    entries = entries_of(tensors)
    generator = torch.Generator().manual_seed(2)
    encoder, decoder, engine = DeltaEncoder(settings), DeltaDecoder(settings), MirrorEngine()
    kinds = []
    with FakeDevice() as device:
        for step in range(3):
            if step:
                perturb(tensors, 0.05, generator)
            gathered = on_device(device, tensors)
            device.reset_peak()
            encoder.begin_sync(())
            payload, encoding = encoder.encode(gathered, entries)
            took = device.peak - device.alive_at_reset  # the encoder's device memory at its peak
            received = device.tensor(payload.cpu())  # a broadcast delivers it on the receiver's device
            assert decoder.apply(engine, received, entries, encoding)
            kinds.append(encoding.kind)
            base = [t for t in encoder.base.values()]
            assert all(isinstance(t, DeviceTensor) == (copies == "device") for t in [*base, *decoder.mirror.values()])
            if copies == "host":  # nothing on the device: the bucket is copied to the host and coded there
                assert took == 0 and not isinstance(payload, DeviceTensor)
        assert_bytes_equal(engine, tensors)  # in the engine's device memory
    assert kinds == ["full", "delta", "delta"]


def test_a_receiver_on_a_device_stages_and_mirrors_in_host_memory():
    """``copies="host"``: a rollout process on a GPU stages a sync's buckets and keeps its mirror in host
    memory (what it received from a broadcast is copied out and freed); ``"device"`` keeps them there."""
    tensors = make_tensors(DTYPE_CASES["bf16"])
    entries = entries_of(tensors)
    for copies in ("host", "device"):
        encoder, gate, engine = DeltaEncoder(DeltaSync(max_share=0.5)), EngineGate(), MirrorEngine()
        with FakeDevice() as device:
            receiver = WeightReceiver(FakeDevice.device, gate)
            receiver.configure_delta(DeltaSync(max_share=0.5, copies=copies))
            for version in (1, 2):
                tensors["a"].view(-1)[version] += 1
                encoder.begin_sync(())
                payload, encoding = encoder.encode(tensors, entries)
                device.reset_peak()
                stats = receiver.load(engine, Bucket(entries, payload.numpy(), encoding), version, 0, 1)
                assert stats["mismatched"] == [] and engine.weight_version == version
                mirrored = list(gate.decoder.mirror.values())
                if copies == "host":
                    assert device.peak == device.alive_at_reset and not any(isinstance(t, DeviceTensor) for t in mirrored)
                else:
                    assert all(isinstance(t, DeviceTensor) for t in mirrored)
            assert_bytes_equal(engine, tensors)


def test_a_device_scan_holds_one_chunk_beyond_the_indices_it_keeps_and_stops_past_the_limit(monkeypatch):
    """A GPU's scan (torch passes) compares a chunk at a time: with every word changed and a limit of 100 it
    stops after the first chunk, and never holds more than a chunk's compare and indices beside the
    indices it keeps (a whole-bucket ``nonzero`` holds 9 bytes a word of the bucket)."""
    chunk, words = 4096, 1 << 18
    monkeypatch.setattr(delta, "DEVICE_SCAN_WORDS", chunk, raising=False)
    generator = torch.Generator().manual_seed(0)
    new = torch.randint(-2**15, 2**15, (words,), dtype=torch.int16, generator=generator)
    sparse = new.clone()
    sparse[torch.randperm(words, generator=generator)[:300]] += 1
    with FakeDevice() as device:
        for old, limit, expect_found in ((new + 1, 100, False), (sparse, 1000, True)):
            a, b = device.tensor(new), device.tensor(old)
            device.reset_peak()
            found, scanned = delta.changed_words(a, b, limit)
            extra = device.peak - device.alive_at_reset
            assert (found is not None) == expect_found
            if expect_found:
                assert torch.equal(found.cpu(), torch.ne(new, old).nonzero().view(-1)) and scanned == words
                assert extra <= 9 * chunk + 2 * 8 * 300  # a chunk's compare and indices; the kept ones, and their cat
            else:
                assert scanned == chunk and extra <= 9 * chunk
