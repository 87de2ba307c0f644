"""The foundation every layer may use: the user-facing error, progress output, tensor helpers."""
