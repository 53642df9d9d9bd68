"""The former name of :mod:`.resume_choice` (which checkpoint a resume reads), kept only for
save/memory_save, which imports ``durable_step`` from here."""

from .resume_choice import durable_step  # noqa: F401
