"""The request-body limits the API enforces, in a module of their own: the CLI's flags default to them before the
engine process starts, when the API's modules are not imported yet."""

DEFAULT_MAX_BODY_BYTES = 8 << 20
# Deepest nesting of arrays and objects a body may have (the body itself is level 1). Real requests (chat messages,
# JSON schemas, tools) stay far below; deeper ones could exhaust the recursion of the parsers behind us.
MAX_JSON_DEPTH = 64
