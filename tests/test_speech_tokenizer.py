"""The 12 Hz speech tokenizer: parity with the reference `qwen_tts` package on tiny random
checkpoints, exactness of the streaming decoders (one stream, and many streams that share one decoder
and join, pause and leave at different times) against offline decoding, and damaged files."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.codec import SpeechTokenizer
from pipeline.errors import CheckpointError
from pipeline.tiny import TINY_SPEECH_TOKENIZER_CONFIG, write_tiny_speech_tokenizer

SR = 24000
HOP = 1920  # samples per code frame
TOL = 1e-5  # max abs difference, float32

class OfficialTokenizer:
    """qwen_tts.Qwen3TTSTokenizer for `path`, run by tests/reference_runner.py: it builds on transformers'
    MimiModel as it was up to 5.15, which later releases split into encoder and decoder halves."""

    def __init__(self, runner, path: Path):
        self.runner, self.path = runner, str(path)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """`load_state_dict(state, strict=True)` on the official model: fails unless the names are the same both ways."""
        self.runner.run("tokenizer_encode", {f"state.{name}": t for name, t in state.items()}, path=self.path)

    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        return self.runner.run("tokenizer_encode", {"wav": wav}, path=self.path)[0]["codes"]

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The official decode(): in windows of 300 frames with 25 frames of left context beyond 300."""
        return self.runner.run("tokenizer_decode", {"codes": codes}, path=self.path)[0]["wav"]

    def decoder_forward(self, codes: torch.Tensor) -> torch.Tensor:
        """The official decoder module's own forward over all the frames at once."""
        return self.runner.run("tokenizer_decoder_forward", {"codes": codes}, path=self.path)[0]["wav"]


def _codes(frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2048, (frames, 16), generator=g)


def _chirp_with_noise(seconds: float) -> torch.Tensor:
    t = torch.arange(int(seconds * SR)) / SR
    g = torch.Generator().manual_seed(1)
    return 0.4 * torch.sin(2 * math.pi * (100 * t + 300 * t ** 2)) + 0.05 * torch.randn(len(t), generator=g)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    write_tiny_speech_tokenizer(directory, seed=0)
    return directory


@pytest.fixture(scope="module")
def ours(checkpoint) -> SpeechTokenizer:
    return SpeechTokenizer.from_pretrained(checkpoint, "cpu", torch.float32)


@pytest.fixture(scope="module")
def reference(checkpoint, official_runner) -> OfficialTokenizer:
    return OfficialTokenizer(official_runner, checkpoint / "speech_tokenizer")


def test_parameter_names_are_the_official_ones(ours, reference):
    # Strict both ways: every parameter of ours is one of the reference's and none is missing.
    reference.load_state_dict(ours.state_dict())


def test_encode_matches_reference(ours, reference):
    wav = _chirp_with_noise(3.03)  # not a whole number of frames: ceil(samples / 1920) frames
    codes = ours.encode(wav)
    expected = reference.encode(wav)
    assert codes.dtype == torch.long and codes.shape == (math.ceil(len(wav) / HOP), 16)
    assert torch.equal(codes.cpu(), expected.cpu())
    # A checkpoint that maps all audio to a few codes would make the equality vacuous.
    assert min(len(codes[:, q].unique()) for q in range(16)) > 5


def test_decode_matches_reference(ours, reference):
    codes = _codes(120, seed=2)  # longer than the 72-frame attention window
    wav = ours.decode(codes)
    expected = reference.decode(codes)
    assert wav.dtype == torch.float32 and wav.shape == (120 * HOP,)
    assert _max_diff(wav, expected) < TOL
    # Non-trivial and unclipped, or the comparison would prove little (the reference clamps).
    assert wav.std() > 1e-3 and wav.abs().max() < 0.9


def test_decode_beyond_300_frames_is_one_causal_pass(ours, reference):
    # Beyond 300 frames the reference's decode() works in windows of 300 frames with 25 frames of
    # left context, so its frames 300.. differ from what the model computes over the whole
    # sequence (the 72-frame attention and the convs see a truncated past). Ours decodes all
    # frames causally at once, so the oracle is the reference decoder module's own full forward.
    codes = _codes(340, seed=3)
    wav = ours.decode(codes)
    full = reference.decoder_forward(codes)
    assert _max_diff(wav, full) < TOL
    windowed = reference.decode(codes)
    assert _max_diff(wav[:300 * HOP], windowed[:300 * HOP]) < TOL
    assert _max_diff(wav[300 * HOP:], windowed[300 * HOP:]) > 1e-3  # the windowing is audible


SCHEDULES = {
    "one_frame": [1] * 100,
    "ramp": [1, 2, 4, 8, 16, 16, 16, 16, 16, 5],
    "irregular": [3, 7, 5] * 6 + [10],
    "whole": [100],
}


@pytest.fixture(scope="module")
def long_codes() -> torch.Tensor:
    return _codes(100, seed=4)


@pytest.fixture(scope="module")
def offline_wav(ours, long_codes) -> torch.Tensor:
    return ours.decode(long_codes)


def _stream(stream, codes: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    assert sum(schedule) == len(codes)
    parts, start = [], 0
    for n in schedule:
        part = stream.decode_chunk(codes[start:start + n])
        assert part.shape == (n * HOP,)
        parts.append(part)
        start += n
    return torch.cat(parts)


@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_streaming_equals_offline(ours, long_codes, offline_wav, schedule):
    assert _max_diff(_stream(ours.stream_decoder(), long_codes, schedule), offline_wav) < TOL


def test_reset_starts_a_new_stream(ours, long_codes, offline_wav):
    stream = ours.stream_decoder()
    _stream(stream, long_codes[:90], [30, 60])  # past the window, so every state is dirty
    stream.reset()
    assert _max_diff(_stream(stream, long_codes, SCHEDULES["ramp"]), offline_wav) < TOL


@pytest.mark.parametrize("ref_frames", [5, 80])  # shorter / longer than what prime() vocodes
def test_primed_stream_equals_offline_without_the_reference_part(ours, reference, ref_frames):
    # Voice clone: the reference codes are decoder context, and exactly their frames are removed.
    ref_codes, new_codes = _codes(ref_frames, seed=5), _codes(30, seed=6)
    stream = ours.stream_decoder()
    stream.prime(ref_codes)
    wav = _stream(stream, new_codes, [1, 2, 4, 8, 15])
    both = torch.cat([ref_codes, new_codes])
    expected = reference.decode(both)[ref_frames * HOP:]
    assert _max_diff(wav, expected) < TOL
    assert _max_diff(wav, ours.decode(both)[ref_frames * HOP:]) < TOL


def test_bfloat16_runs_close_to_float32(checkpoint, ours, long_codes, offline_wav):
    model = SpeechTokenizer.from_pretrained(checkpoint, "cpu", torch.bfloat16)
    wav = model.decode(long_codes[:40])
    assert wav.dtype == torch.float32
    assert _max_diff(wav, offline_wav[:40 * HOP]) < 0.05
    streamed = _stream(model.stream_decoder(), long_codes[:40], [1, 3, 36])
    assert _max_diff(streamed, wav) < 0.05
    audio = _chirp_with_noise(1.0)
    assert model.encode(audio).shape == ours.encode(audio).shape


def test_missing_weights_name_the_file(checkpoint, tmp_path):
    (tmp_path / "speech_tokenizer").mkdir()
    config = json.loads((checkpoint / "speech_tokenizer" / "config.json").read_text())
    (tmp_path / "speech_tokenizer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        SpeechTokenizer.from_pretrained(tmp_path)


def test_encoder_without_latent_projection_matches_reference(tmp_path, official_runner):
    # Mimi builds the quantizers' input/output projections only when vector_quantization_hidden_dimension
    # differs from hidden_size; with the two equal the codebooks quantize the latents as they are.
    encoder = dict(TINY_SPEECH_TOKENIZER_CONFIG["encoder_config"], vector_quantization_hidden_dimension=32, codebook_dim=32)
    assert encoder["hidden_size"] == 32
    write_tiny_speech_tokenizer(tmp_path, seed=1, config=dict(TINY_SPEECH_TOKENIZER_CONFIG, encoder_config=encoder))
    ours = SpeechTokenizer.from_pretrained(tmp_path)
    reference = OfficialTokenizer(official_runner, tmp_path / "speech_tokenizer")
    assert not any("residual_vector_quantizer.input_proj" in name for name in ours.state_dict())
    reference.load_state_dict(ours.state_dict())
    wav = _chirp_with_noise(2.5)
    codes = ours.encode(wav)
    assert torch.equal(codes.cpu(), reference.encode(wav).cpu())
    assert min(len(codes[:, q].unique()) for q in range(16)) > 5


def test_codebook_dim_must_be_the_quantized_size(checkpoint, tmp_path):
    shutil.copytree(checkpoint / "speech_tokenizer", tmp_path / "speech_tokenizer")
    config_path = tmp_path / "speech_tokenizer" / "config.json"
    config = json.loads(config_path.read_text())
    config["encoder_config"]["codebook_dim"] = 8
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="codebook_dim 8 differs from vector_quantization_hidden_dimension 16") as e:
        SpeechTokenizer.from_pretrained(tmp_path)
    assert str(config_path) in str(e.value)


# --- Damaged files: a CheckpointError naming the file ------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _drop_one_tensor(path: Path) -> None:
    weights = load_file(path)
    del weights[sorted(weights)[0]]
    save_file(weights, path)


DAMAGED = [
    pytest.param("config.json", _truncate, "is not valid JSON", id="config-truncated"),
    pytest.param("config.json", lambda p: p.write_text("<html>502 Bad Gateway</html>"), "is not valid JSON", id="config-html"),
    pytest.param("config.json", lambda p: p.write_text("[]"), "does not hold a JSON object", id="config-list"),
    pytest.param("model.safetensors", _truncate, "damaged or is not a safetensors file", id="weights-truncated"),
    pytest.param("model.safetensors", lambda p: p.write_bytes(bytes(range(256)) * 64), "damaged or is not a safetensors file",
                 id="weights-garbage"),
    pytest.param("model.safetensors", lambda p: p.write_bytes(b""), "damaged or is not a safetensors file", id="weights-empty"),
    pytest.param("model.safetensors", _drop_one_tensor, "do not match the config", id="weights-missing-tensor"),
]


@pytest.mark.parametrize("name, damage, problem", DAMAGED)
def test_damaged_file_is_a_checkpoint_error_naming_it(checkpoint, tmp_path, name, damage, problem):
    shutil.copytree(checkpoint / "speech_tokenizer", tmp_path / "speech_tokenizer")
    damage(tmp_path / "speech_tokenizer" / name)
    with pytest.raises(CheckpointError, match=problem) as e:
        SpeechTokenizer.from_pretrained(tmp_path)
    assert str(tmp_path / "speech_tokenizer" / name) in str(e.value)


# --- Many streams sharing one decoder ------------------------------------------------------------------------

ROW_FRAMES = (80, 25, 30)  # row 0 outlasts the 72-frame window
ROW_STARTS = (0, 3, 6)  # the turn at which each row joins
ROW_PAUSES = ({4, 5, 20}, {7, 8}, {10})  # turns a row skips after joining
PRIMED_ROW, REF_FRAMES = 2, 10
CHUNK_SIZES = (1, 1, 2, 1, 3, 13, 5)  # frames per call, in turn: 3, 13 and 5 are decoded in pieces


def _out(frames: int) -> torch.Tensor:
    return torch.full((frames * HOP,), float("nan"))  # NaN: a sample the decoder did not write shows


def _decode_interleaved(multi, rows: list[torch.Tensor], ref_codes: torch.Tensor) -> list[torch.Tensor]:
    """Each row's audio when the rows join, pause and leave on the schedule above, taking turns on
    one decoder. Asserts after every call that the other rows' stored state is bit for bit as it was."""
    g = torch.Generator().manual_seed(12)
    # Every row starts dirty, so a row that joins is fresh only if reset_row made it so.
    for r in range(len(rows)):
        multi.decode(r, torch.randint(0, 2048, (9, 16), generator=g), _out(9))
    primed = multi.primed_state(ref_codes)
    done, parts, turn = [0] * len(rows), [[] for _ in rows], 0
    while any(d < len(codes) for d, codes in zip(done, rows)):
        n = CHUNK_SIZES[turn % len(CHUNK_SIZES)]
        for r in range(len(rows)):
            if turn == ROW_STARTS[r]:
                multi.reset_row(r, primed if r == PRIMED_ROW else None)
            if ROW_STARTS[r] <= turn and turn not in ROW_PAUSES[r] and done[r] < len(rows[r]):
                chunk = rows[r][done[r]:done[r] + n]
                before = [multi.row_state(other) for other in range(len(rows))]
                out = _out(len(chunk))
                multi.decode(r, chunk, out, lane=(turn + r) % multi.lanes)  # a row's calls change lanes
                parts[r].append(out)
                done[r] += len(chunk)
                for other in set(range(len(rows))) - {r}:
                    assert all(torch.equal(b, a) for b, a in zip(before[other], multi.row_state(other)))
        turn += 1
    return [torch.cat(p) for p in parts]


def _check_interleaved(model: SpeechTokenizer, use_cuda_graphs: bool) -> None:
    rows = [_codes(n, seed=20 + r) for r, n in enumerate(ROW_FRAMES)]
    ref_codes = _codes(REF_FRAMES, seed=30)
    # Two working states (lanes) shared by the three rows.
    wavs = _decode_interleaved(model.multi_stream_decoder(len(rows), use_cuda_graphs, lanes=2), rows, ref_codes)
    for r, (codes, wav) in enumerate(zip(rows, wavs)):
        context = ref_codes if r == PRIMED_ROW else codes[:0]
        expected = model.decode(torch.cat([context, codes]))[len(context) * HOP:]
        assert _max_diff(wav, expected) < TOL, f"row {r}"


def test_streams_sharing_one_decoder_join_pause_and_leave_independently(ours):
    _check_interleaved(ours, use_cuda_graphs=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_streams_sharing_one_decoder_with_cuda_graphs(checkpoint):
    _check_interleaved(SpeechTokenizer.from_pretrained(checkpoint, "cuda"), use_cuda_graphs=True)


def test_a_stream_sounds_the_same_in_any_row_among_any_neighbours(ours):
    """Bit for bit: same codes and chunk sizes give the same audio, alone or between other streams."""
    codes, chunks = _codes(40, seed=14), (1, 2, 4, 8, 16, 9)
    alone = ours.multi_stream_decoder(1)
    expected = []
    for chunk in codes.split(chunks):
        expected.append(_out(len(chunk)))
        alone.decode(0, chunk, expected[-1])
    shared, g, got = ours.multi_stream_decoder(3, lanes=3), torch.Generator().manual_seed(15), []
    for i, chunk in enumerate(codes.split(chunks)):
        shared.decode(0, torch.randint(0, 2048, (3, 16), generator=g), _out(3), lane=i % 3)
        got.append(_out(len(chunk)))
        shared.decode(2, chunk, got[-1], lane=(i + 1) % 3)
        shared.decode(1, torch.randint(0, 2048, (len(chunk), 16), generator=g), _out(len(chunk)), lane=(i + 2) % 3)
    assert torch.equal(torch.cat(got), torch.cat(expected))


def _batched_stream(multi, lane: int, slot_of: list[int], neighbours: int, chunks: list[torch.Tensor], primed=None) -> torch.Tensor:
    """Row 1's audio when its first two chunks go one-stream and its 16-frame chunks through batched
    `lane`, at slot `slot_of[i]` of call i, beside `neighbours` other rows with random codes."""
    g = torch.Generator().manual_seed(16)
    multi.reset_row(1, primed)
    parts = []
    for i, chunk in enumerate(chunks):
        parts.append(_out(len(chunk)))
        if len(chunk) != multi.BATCH_FRAMES:
            multi.decode(1, chunk, parts[-1])
            continue
        others = [r for r in range(multi.streams) if r != 1][:neighbours]
        rows = others[:slot_of[i]] + [1] + others[slot_of[i]:]
        codes = [chunk if r == 1 else torch.randint(0, 2048, (multi.BATCH_FRAMES, 16), generator=g) for r in rows]
        outs = [parts[-1] if r == 1 else _out(multi.BATCH_FRAMES) for r in rows]
        multi.decode_batch(rows, codes, outs, lane)
    return torch.cat(parts)


def _check_batched(model: SpeechTokenizer, use_cuda_graphs: bool) -> None:
    codes = _codes(4 + 16 * 3, seed=17)
    chunks = list(codes.split([1, 3, 16, 16, 16]))
    multi = model.multi_stream_decoder(4, use_cuda_graphs, lanes=1, batch_lanes=2, slots=3)
    alone = _batched_stream(multi, 1, [0] * 5, 0, chunks)
    crowded = _batched_stream(multi, 2, [0, 0, 2, 1, 0], 2, chunks)
    assert torch.equal(alone, crowded) and not alone.isnan().any()
    assert _max_diff(alone, model.decode(codes)) < TOL
    ref_codes = _codes(REF_FRAMES, seed=30)
    primed = _batched_stream(multi, 1, [1] * 5, 1, chunks, multi.primed_state(ref_codes))
    assert _max_diff(primed, model.decode(torch.cat([ref_codes, codes]))[REF_FRAMES * HOP:]) < TOL
    state = multi.row_state(0)
    multi.decode_batch([1], [codes[4:20]], [_out(16)], 1)
    assert all(torch.equal(a, b) for a, b in zip(state, multi.row_state(0)))  # padding slots write only their scratch rows


def test_a_batched_call_decodes_each_stream_as_if_alone_in_it(ours):
    """A row's audio through batched calls is the same bit for bit whatever shares the calls and in
    whichever slot it sits (a padded call of one row too), the other rows' states are theirs, and
    the stream stays the offline decode of its codes (a primed stream: after its reference)."""
    _check_batched(ours, use_cuda_graphs=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_batched_call_with_cuda_graphs(checkpoint):
    _check_batched(SpeechTokenizer.from_pretrained(checkpoint, "cuda"), use_cuda_graphs=True)


def test_batched_calls_take_their_own_lanes_and_chunks(ours):
    multi = ours.multi_stream_decoder(3, lanes=1, batch_lanes=1, slots=2)
    assert [multi.batched(lane) for lane in range(2)] == [False, True]
    chunk = _codes(16, seed=18)
    with pytest.raises(ValueError, match="Lane 1 is batched"):
        multi.decode(0, chunk, _out(16), lane=1)
    with pytest.raises(ValueError, match="1 to 2 distinct rows in a batched lane"):
        multi.decode_batch([0, 1, 2], [chunk] * 3, [_out(16)] * 3, 1)
    with pytest.raises(ValueError, match="1 to 2 distinct rows in a batched lane"):
        multi.decode_batch([0], [chunk], [_out(16)], 0)
    with pytest.raises(ValueError, match="chunks of 16 frames"):
        multi.decode_batch([0], [chunk[:8]], [_out(8)], 1)
    assert ours.multi_stream_decoder(3, lanes=2, batch_lanes=2, slots=1).batch_lanes == 0  # one slot: no batched lanes


def test_call_pieces_are_a_fixed_split_into_sizes_up_to_16(ours):
    pieces = ours.multi_stream_decoder(1).pieces
    assert pieces(1) == [1] and pieces(16) == [16] and pieces(13) == [8, 4, 1] and pieces(64) == [16] * 4
    assert all(sum(pieces(n)) == n for n in range(1, 100))


def test_reset_row_starts_a_fresh_stream_and_leaves_the_others(ours):
    multi = ours.multi_stream_decoder(2)
    codes = _codes(30, seed=13)
    multi.decode(0, codes[:20], _out(20))
    multi.decode(1, codes[10:], _out(20))
    other = multi.row_state(1)
    multi.reset_row(0)
    assert not any(t.any() for t in multi.row_state(0))
    assert all(torch.equal(a, b) for a, b in zip(other, multi.row_state(1)))
    parts = []
    for chunk in codes.split(4):
        parts.append(_out(len(chunk)))
        multi.decode(0, chunk, parts[-1])
    assert _max_diff(torch.cat(parts), ours.decode(codes)) < TOL


def test_a_primed_row_needs_a_one_stream_state(ours):
    multi = ours.multi_stream_decoder(2)
    before = multi.row_state(0)
    with pytest.raises(ValueError, match="one-stream state"):
        multi.reset_row(0, [t[:, :-1] for t in multi.primed_state(_codes(3, seed=1))])
    assert all(torch.equal(a, b) for a, b in zip(before, multi.row_state(0)))
