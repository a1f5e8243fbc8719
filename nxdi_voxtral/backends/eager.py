"""eager: the graph modules run as they are (no artifact). The reference every other backend is tested against."""
from __future__ import annotations

from .base import Backend


class Eager(Backend):
    name = "eager"
    summary = "the graph modules as they are, on CPU (no artifact)"
    from_checkpoint = True
    builds = False


EAGER = Eager()
