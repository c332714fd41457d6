"""The one error hierarchy of the server.

Each error carries the HTTP status it maps to and also inherits the stdlib error it stands for,
so plain Python code can catch it naturally. `app.py` has the single handler that turns these into
the response body; inside a request's future they become `{"error", "category"}`.
"""


class TinkerServerError(Exception):
    """Base of every error the server reports to a client."""

    status_code = 500
    category = "server"


class InvalidRequest(TinkerServerError, ValueError):
    """The request is malformed or asks for something impossible (a user error)."""

    status_code = 400
    category = "user"


class Unauthorized(TinkerServerError, PermissionError):
    """The request carries no valid API key."""

    status_code = 401
    category = "user"


class Forbidden(TinkerServerError, PermissionError):
    """The caller may not do this: server-wide data needs an admin key; a download URL's signature is wrong or
    expired."""

    status_code = 403
    category = "user"


class NotFound(TinkerServerError, LookupError):
    """The named session, model, sampler, future or checkpoint does not exist."""

    status_code = 404
    category = "user"


class Conflict(TinkerServerError):
    """A `seq_id` was reused with a different payload, or a name is already taken."""

    status_code = 409
    category = "user"


class Gone(TinkerServerError):
    """The session was finished or the resource expired."""

    status_code = 410
    category = "user"


class Overloaded(TinkerServerError):
    """Too much work is in flight: the SDK waits and sends the same request again (429 is its backpressure)."""

    status_code = 429


class PayloadTooLarge(InvalidRequest):
    """A body, image or sequence is over a configured limit."""

    status_code = 413


class EngineUnavailable(TinkerServerError, ConnectionError):
    """The sampling engine (a vLLM server) is down, restarting, or gave up restarting."""

    status_code = 503


class InsufficientStorage(TinkerServerError, OSError):
    """The server's disk (or its database) is full: nothing was changed; free space and send again."""

    status_code = 507


class StorageUnavailable(TinkerServerError):
    """The journal database or the checkpoint directory cannot be used right now; send the request again."""

    status_code = 503


class ShuttingDown(TinkerServerError):
    """The server is stopping and accepts no more work; send the request again once it is back."""

    status_code = 503


class TrainingRankLost(ShuttingDown):
    """A training rank died: the training group cannot go on without it, so the server stops."""

    def __init__(self, rank: int, ran: bool):
        if ran:
            super().__init__(f"{rank_lost_cause(rank)} while this request ran; its effect is lost and the server "
                             f"stops: send the request again once it is back (resume a run from its last checkpoint)")
        else:
            super().__init__(f"{rank_lost_cause(rank)}: the server shut down before this request ran; send it again "
                             f"once it is back")


def rank_lost_cause(rank: int) -> str:
    return f"training rank {rank} died (killed, out of memory, or its node went down)"


def without_server_paths(message: str, *directories: object) -> str:
    """A message for a client, with the server's own directories replaced by a placeholder."""
    for directory in directories:
        message = message.replace(str(directory), "<server>")
    return message
