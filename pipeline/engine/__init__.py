"""One engine per loaded model: the batched decode step, the per-listener vocoder, the scheduler (its policy) and the loop that carries it out."""
from pipeline.engine.core import DEFAULT_SCHEDULE, Chunk, Engine, Handle, Job, Mailbox, Queued, Segment, Waiting
from pipeline.engine.decoder import BatchDecoder, DecodeConfig
from pipeline.engine.sampling import SamplingConfig
from pipeline.engine.scheduler import Scheduler

__all__ = ["DEFAULT_SCHEDULE", "BatchDecoder", "Chunk", "DecodeConfig", "Engine", "Handle", "Job", "Mailbox", "Queued", "SamplingConfig", "Scheduler", "Segment", "Waiting"]
