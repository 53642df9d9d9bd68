"""The one signal between the planners and the hooks that is not an error."""


class Unsupported(Exception):
    """A layout this backend does not load: DeepSpeed's own loader takes the call (or, resuming
    straight from a ZeRO checkpoint, where there is no universal folder for it, the load stops)."""
