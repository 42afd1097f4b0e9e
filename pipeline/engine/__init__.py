"""One engine per loaded model: the batched decode step, the per-listener vocoder and the scheduler loop."""
from pipeline.engine.core import DEFAULT_SCHEDULE, Chunk, Engine, Handle, Job, Mailbox, Queued, Segment, Waiting
from pipeline.engine.decoder import BatchDecoder
from pipeline.engine.sampling import SamplingConfig

__all__ = ["DEFAULT_SCHEDULE", "BatchDecoder", "Chunk", "Engine", "Handle", "Job", "Mailbox", "Queued", "SamplingConfig", "Segment", "Waiting"]
