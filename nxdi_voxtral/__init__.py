"""nxdi_voxtral: Voxtral-Mini-3B as fixed-shape graphs for Trainium2, with exact speculative decoding."""
from .application import NxDVoxtralSpecDec, Transcription
from .errors import (ArtifactError, AudioError, AudioTooLongError, CheckpointError, ConfigError,
                     DraftMismatchError, VoxtralError)
from .graphs import Buckets

__all__ = ["NxDVoxtralSpecDec", "Transcription", "Buckets", "VoxtralError", "AudioError", "AudioTooLongError",
           "CheckpointError", "ConfigError", "DraftMismatchError", "ArtifactError"]
__version__ = "0.1.0"
