"""The talker's prompt against transformers' `Qwen3OmniMoeForConditionalGeneration` helpers
(`_get_talker_user_parts`, `_get_talker_assistant_parts`) on a tiny random talker (CPU, fp32); which
positions of a conversation are user turns; ids from the checkpoint's config; unknown speakers."""
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration as HFOmni

from pipeline.errors import CheckpointError, TTSInputError
from pipeline.omni.prompt import PromptIds, assistant_part, text_specials, user_part, user_positions
from pipeline.omni.talker import OmniTalker, OmniTalkerConfig
from pipeline.tiny import randomize_
from tests.test_omni_talker import _hf_config

IM_START, IM_END, USER, ASSISTANT, SYSTEM, NL, AUDIO = 151644, 151645, 872, 77091, 8948, 198, 151646
# Released Qwen3-Omni values, which differ from the config classes' defaults.
CONFIG = {
    "im_start_token_id": IM_START, "user_token_id": USER, "assistant_token_id": ASSISTANT,
    "tts_pad_token_id": 151671, "tts_bos_token_id": 151672, "tts_eos_token_id": 151673,
    "talker_config": {"codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157, "codec_pad_id": 2148,
                      "codec_bos_id": 2149, "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303}},
    "thinker_config": {"audio_token_id": AUDIO, "image_token_id": 151655, "video_token_id": 151656},
}
THINKER = 40


def _conversation() -> torch.Tensor:
    """system, user (audio then text), an earlier assistant answer, user again, then the reply's start."""
    turns = [[IM_START, SYSTEM, NL, 11, 12, IM_END, NL],
             [IM_START, USER, NL, 151669, AUDIO, AUDIO, AUDIO, 151670, 21, 22, IM_END, NL],
             [IM_START, ASSISTANT, NL, 31, 32, 33, IM_END, NL],
             [IM_START, USER, NL, 41, IM_END, NL],
             [IM_START, ASSISTANT, NL]]
    return torch.tensor([t for turn in turns for t in turn])


@pytest.fixture(scope="module")
def setup():
    config = _hf_config()
    ours = OmniTalker(OmniTalkerConfig.from_dict(config.to_dict())).eval()
    with torch.no_grad():
        randomize_(ours, torch.Generator().manual_seed(0))
    ids = PromptIds.from_config(CONFIG)
    hf_config = SimpleNamespace(talker_config=SimpleNamespace(text_config=config.text_config, **CONFIG["talker_config"]),
                                tts_pad_token_id=CONFIG["tts_pad_token_id"])
    return ours, ids, SimpleNamespace(talker=_HFTalkerView(ours), config=hf_config)


class _HFTalkerView:
    """The attributes transformers' helpers read from `self.talker`, backed by our modules (whose
    equality with transformers' talker tests/test_omni_talker.py shows)."""

    def __init__(self, talker: OmniTalker):
        self.text_projection, self.hidden_projection = talker.text_projection, talker.hidden_projection
        self.get_input_embeddings = lambda: talker.model.codec_embedding
        self.dtype = torch.float32


def test_user_positions_are_every_user_turn_and_nothing_else():
    ids = PromptIds.from_config(CONFIG)
    conversation = _conversation()
    expected = list(range(7, 19)) + list(range(27, 33))
    assert user_positions(conversation, ids).tolist() == expected


def test_user_part_matches_transformers(setup):
    ours, ids, hf_self = setup
    conversation = _conversation()
    g = torch.Generator().manual_seed(1)
    embeds, hidden = torch.randn(len(conversation), THINKER, generator=g), torch.randn(len(conversation), THINKER, generator=g)
    mask = torch.isin(conversation, torch.tensor(ids.multimodal))[None]
    with torch.no_grad():
        expected = HFOmni._get_talker_user_parts(hf_self, 0, len(conversation), mask, hidden[None], embeds[None])[0]
        got = user_part(ours, conversation, embeds, hidden, ids)
    positions = user_positions(conversation, ids)
    assert (got - expected[positions]).abs().max() <= 1e-6  # projected over other row counts: float rounding
    assert not torch.equal(got[4], ours.text_projection(embeds[positions[4]]))  # an audio position: hidden_projection


def test_assistant_part_matches_transformers(setup):
    ours, ids, hf_self = setup
    g = torch.Generator().manual_seed(2)
    embeds = torch.randn(1, 4, THINKER, generator=g)  # <|im_start|> assistant \n, first token
    embedding = torch.nn.Embedding(151936, THINKER)
    with torch.no_grad():
        specials = text_specials(ours, embedding, ids)
        pad, bos, eos = (s[None, None] for s in specials)
        expected, _, trailing = HFOmni._get_talker_assistant_parts(hf_self, 0, 4, ids.speaker("Ethan"), embeds, pad, bos, eos)
        got = assistant_part(ours, embeds[0], specials, ids.speaker("Ethan"), ids)
    assert got.shape == (9, 32)
    assert (got - expected[0]).abs().max() <= 1e-6
    assert torch.equal(trailing[0, -1], specials[2])  # after the answer: tts_eos


def test_ids_come_from_the_checkpoint_and_unknown_speakers_are_named():
    ids = PromptIds.from_config(CONFIG)
    assert (ids.codec_pad, ids.codec_bos, ids.speaker("Chelsie")) == (2148, 2149, 2301)
    with pytest.raises(TTSInputError, match="Unknown speaker 'Bob'; this model has aiden, chelsie, ethan"):
        ids.speaker("Bob")
    broken = {**CONFIG, "talker_config": {k: v for k, v in CONFIG["talker_config"].items() if k != "codec_bos_id"}}
    with pytest.raises(CheckpointError, match="codec_bos_id"):
        PromptIds.from_config(broken)
