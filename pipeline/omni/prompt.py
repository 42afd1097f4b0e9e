"""What Qwen3-Omni's talker reads: the user turns of the conversation and a 9-position assistant
part as its prompt, then one projected text token per frame.

- User turns (every one, from its `<|im_start|>` up to the next turn; not the system prompt, not
  earlier assistant turns): text positions through `text_projection` of the thinker's input
  embeddings, audio/image/video positions through `hidden_projection` of the thinker's hidden
  states at layer `accept_hidden_layer`.
- Assistant part: the text stream `<|im_start|>`, `assistant`, `\\n`, 4 x tts_pad, tts_bos, the first
  generated token, summed with the codec stream 0, 0, 0, nothink, think_bos, think_eos, speaker,
  codec_pad, codec_bos.
- Then, per frame, the next generated token (the first one was in the prompt); after the last one
  tts_eos once, then tts_pad; `<|im_end|>` is never fed.

Every id comes from the checkpoint's config.json: the released values differ from the defaults of
transformers' config classes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.errors import CheckpointError, TTSInputError
from pipeline.omni.talker import OmniTalker

ASSISTANT_TEXT_POSITIONS = 3  # <|im_start|> assistant \n


@dataclass(frozen=True)
class PromptIds:
    im_start: int
    user: int
    assistant: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    codec_pad: int
    codec_bos: int
    multimodal: tuple[int, ...]  # audio, image and video placeholders
    speakers: dict[str, int]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PromptIds":
        talker, thinker = config.get("talker_config") or {}, config.get("thinker_config") or {}
        try:
            return cls(config["im_start_token_id"], config["user_token_id"], config["assistant_token_id"],
                       config["tts_pad_token_id"], config["tts_bos_token_id"], config["tts_eos_token_id"],
                       talker["codec_nothink_id"], talker["codec_think_bos_id"], talker["codec_think_eos_id"],
                       talker["codec_pad_id"], talker["codec_bos_id"],
                       tuple(thinker[k] for k in ("audio_token_id", "image_token_id", "video_token_id")),
                       {name.lower(): int(i) for name, i in (talker.get("speaker_id") or {}).items()})
        except KeyError as e:
            raise CheckpointError(f"config.json has no {e.args[0]}, which the talker's prompt needs.") from None

    def speaker(self, name: str) -> int:
        """The codec id of a speaker, by name in any case; an unknown name lists the valid ones."""
        if name.lower() not in self.speakers:
            raise TTSInputError(f"Unknown speaker {name!r}; this model has {', '.join(sorted(self.speakers))}.")
        return self.speakers[name.lower()]


def user_positions(input_ids: torch.Tensor, ids: PromptIds) -> torch.Tensor:
    """Positions [U] of every user turn in a conversation's ids [L], each from its `<|im_start|>`
    to the token before the next `<|im_start|>`."""
    starts = (input_ids == ids.im_start).nonzero().flatten().tolist()
    ends = starts[1:] + [len(input_ids)]
    spans = [torch.arange(s, e) for s, e in zip(starts, ends) if s + 1 < len(input_ids) and input_ids[s + 1] == ids.user]
    return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)


def user_part(talker: OmniTalker, input_ids: torch.Tensor, thinker_embeds: torch.Tensor, thinker_hidden: torch.Tensor,
              ids: PromptIds) -> torch.Tensor:
    """The user turns of the conversation in the talker's space [U, hidden]. thinker_embeds and
    thinker_hidden [L, thinker_hidden]: input embeddings and layer-`accept_hidden_layer` states."""
    positions = user_positions(input_ids, ids)
    multimodal = torch.isin(input_ids[positions], torch.tensor(ids.multimodal, device=input_ids.device))
    text = talker.text_projection(thinker_embeds[positions])
    media = talker.hidden_projection(thinker_hidden[positions])
    return torch.where(multimodal[:, None], media, text)


def text_specials(talker: OmniTalker, thinker_embedding: nn.Embedding, ids: PromptIds) -> torch.Tensor:
    """tts_pad, tts_bos and tts_eos in the talker's space [3, hidden]."""
    specials = torch.tensor([ids.tts_pad, ids.tts_bos, ids.tts_eos], device=thinker_embedding.weight.device)
    return talker.text_projection(thinker_embedding(specials))


def assistant_part(talker: OmniTalker, assistant_embeds: torch.Tensor, specials: torch.Tensor, speaker: int, ids: PromptIds) -> torch.Tensor:
    """The 9 prompt positions after the user turns [9, hidden]. assistant_embeds [4, thinker_hidden]:
    the thinker's input embeddings of `<|im_start|>`, `assistant`, `\\n` and the first generated token."""
    return torch.cat([assistant_prefix(talker, assistant_embeds[:ASSISTANT_TEXT_POSITIONS], specials, speaker, ids),
                      assistant_first(talker, assistant_embeds[ASSISTANT_TEXT_POSITIONS:], ids)])


def assistant_prefix(talker: OmniTalker, header_embeds: torch.Tensor, specials: torch.Tensor, speaker: int, ids: PromptIds) -> torch.Tensor:
    """The first 8 of the 9 assistant positions [8, hidden], which do not depend on the answer.
    header_embeds [3, thinker_hidden]: the thinker's input embeddings of `<|im_start|>`, `assistant`, `\\n`."""
    text = talker.text_projection(header_embeds)
    pad, bos = specials[0], specials[1]
    text_stream = torch.cat([text, pad.expand(4, -1), bos[None]])
    codec = torch.tensor([ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos, speaker, ids.codec_pad], device=header_embeds.device)
    codec_stream = torch.cat([torch.zeros(ASSISTANT_TEXT_POSITIONS, text.shape[-1], dtype=text.dtype, device=text.device),
                              talker.model.codec_embedding(codec)])
    return text_stream + codec_stream


def assistant_first(talker: OmniTalker, first_embed: torch.Tensor, ids: PromptIds) -> torch.Tensor:
    """The 9th assistant position [1, hidden]: the first generated token [1, thinker_hidden] with codec_bos."""
    bos = torch.tensor([ids.codec_bos], device=first_embed.device)
    return talker.text_projection(first_embed) + talker.model.codec_embedding(bos)
