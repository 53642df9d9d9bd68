"""Running plans: the native executor into a staging folder, then publishing it atomically."""
