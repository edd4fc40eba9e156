"""One exception type for every bad input, so the CLI can print it as one line (exit code 2)."""


class KVSumError(ValueError):
    """Raised for invalid arguments or unsupported setups; the message names the argument and what is accepted."""
