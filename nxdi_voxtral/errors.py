"""Typed errors. Every user-facing failure raises a subclass of VoxtralError whose message names the problem."""


class VoxtralError(Exception):
    """Base class of every error this package raises on purpose."""


class AudioError(VoxtralError, ValueError):
    """Audio that cannot be read or used: unreadable file, empty, non-finite samples, bad shape."""


class AudioTooLongError(AudioError):
    """Audio longer than the largest compiled audio bucket."""


class CheckpointError(VoxtralError, ValueError):
    """A checkpoint directory that is missing files or has missing / mis-shaped tensors."""


class ConfigError(VoxtralError, ValueError):
    """Inconsistent configuration: buckets, drafts, generation arguments."""


class DraftMismatchError(ConfigError):
    """A draft model that does not fit the target (vocabulary, hidden size, tokenizer, layer ids)."""


class ArtifactError(VoxtralError, RuntimeError):
    """Compiled artifacts that are missing, corrupted or built for another host configuration."""


class WorkerError(VoxtralError, RuntimeError):
    """A tensor-parallel rank process failed, died or did not answer in time; the message names the rank."""


class ModelClosedError(VoxtralError, RuntimeError):
    """The model was closed, or its rank processes failed: it cannot run graphs any more; create a new one."""
