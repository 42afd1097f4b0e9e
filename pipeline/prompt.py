"""The talker's prefill: how text, control codes, speaker and reference audio are laid over the codec track.

Layout (one row per prefill position; each position is text-track embedding + codec-track embedding):

    [instruction tokens]                                   (custom voice / voice design, optional)
    role tokens "<|im_start|>assistant\\n"                 (text only)
    think/nothink [, language], think_eos, [speaker], pad  (codec) + tts_pad ... tts_bos (text)
    then, by mode:
      non-streaming text: all text tokens + tts_eos over codec_pad, then tts_pad over codec_bos
      streaming text:     first text token over codec_bos; the rest is fed one per generated frame
      ICL voice clone:    reference text + text + tts_eos laid against codec_bos + reference frames
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.model import Talker, TTSConfig

ROLE_TOKENS = 3  # "<|im_start|>", "assistant", "\n"
TEXT_TAIL_TOKENS = 5  # "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n"
REF_TAIL_TOKENS = 2  # "<|im_end|>", "\n"


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def reference_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


@dataclass
class Prompt:
    prefill: torch.Tensor  # [1, L, hidden]
    trailing_text: torch.Tensor  # [T, hidden]: text fed alongside generated frames 0..T-1
    tts_pad: torch.Tensor  # [hidden]: fed alongside frames after the text has run out
    text_tokens: int  # tokens of the text itself, without its framing (what the runaway guard's frame budget counts)


@dataclass
class ICLReference:
    text_ids: torch.Tensor  # [1, N] ids of reference_text(transcript)
    codes: torch.Tensor  # [frames, 16]


def codec_prefix_ids(config: TTSConfig, language_id: int | None) -> list[int]:
    t = config.talker_config
    if language_id is None:
        return [t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id]
    return [t.codec_think_id, t.codec_think_bos_id, language_id, t.codec_think_eos_id]


def build_prompt(
    talker: Talker,
    config: TTSConfig,
    text_ids: torch.Tensor,
    language_id: int | None,
    speaker_embed: torch.Tensor | None = None,
    instruct_ids: torch.Tensor | None = None,
    icl: ICLReference | None = None,
    non_streaming_text: bool = True,
) -> Prompt:
    """text_ids: [1, N] ids of assistant_text(text). Returns the prefill and the per-frame text."""
    t = config.talker_config
    device = text_ids.device

    def codec(ids: list[int]) -> torch.Tensor:
        return talker.model.codec_embedding(torch.tensor([ids], device=device))

    tts_bos, tts_eos, tts_pad = talker.embed_text(
        torch.tensor([[config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]], device=device)
    ).split(1, dim=1)

    codec_track = [codec(codec_prefix_ids(config, language_id))]
    if speaker_embed is not None:
        codec_track.append(speaker_embed.view(1, 1, -1).to(tts_pad.dtype))
    codec_track.append(codec([t.codec_pad_id]))
    codec_track = torch.cat(codec_track, dim=1)
    text_track = torch.cat([tts_pad.expand(-1, codec_track.shape[1] - 1, -1), tts_bos], dim=1)

    parts = []
    if instruct_ids is not None:
        parts.append(talker.embed_text(instruct_ids))
    parts.append(talker.embed_text(text_ids[:, :ROLE_TOKENS]))
    parts.append(text_track + codec_track)

    text_body = text_ids[:, ROLE_TOKENS:-TEXT_TAIL_TOKENS]
    bos = codec([t.codec_bos_id])
    if icl is not None:
        body, trailing = _icl_body(talker, icl, text_body, bos, tts_eos, tts_pad, non_streaming_text, codec([t.codec_pad_id]))
        parts.append(body)
    elif non_streaming_text:
        text = torch.cat([talker.embed_text(text_body), tts_eos], dim=1)
        parts.append(text + codec([t.codec_pad_id]))
        parts.append(tts_pad + bos)
        trailing = tts_pad
    else:
        parts.append(talker.embed_text(text_body[:, :1]) + bos)
        trailing = torch.cat([talker.embed_text(text_body[:, 1:]), tts_eos], dim=1)
    return Prompt(torch.cat(parts, dim=1), trailing[0], tts_pad[0, 0], text_body.shape[1])


def _icl_body(
    talker: Talker,
    icl: ICLReference,
    text_body: torch.Tensor,
    bos: torch.Tensor,
    tts_eos: torch.Tensor,
    tts_pad: torch.Tensor,
    non_streaming_text: bool,
    codec_pad: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference transcript + text against codec_bos + the reference frames. Returns (prefill part, trailing text), both [1, n, hidden]."""
    ref_body = icl.text_ids[:, ROLE_TOKENS:-REF_TAIL_TOKENS]
    text = torch.cat([talker.embed_text(torch.cat([ref_body, text_body], dim=1)), tts_eos], dim=1)
    codes = torch.cat([bos, talker.embed_codes(icl.codes.to(text.device))[None]], dim=1)
    if non_streaming_text:
        return torch.cat([text + codec_pad, codes + tts_pad], dim=1), tts_pad
    if text.shape[1] > codes.shape[1]:
        return text[:, : codes.shape[1]] + codes, text[:, codes.shape[1] :]
    padded = torch.cat([text, tts_pad.expand(-1, codes.shape[1] - text.shape[1], -1)], dim=1)
    return padded + codes, tts_pad
