"""The errors payhook raises. Each docstring is the default message."""

from __future__ import annotations


class PayhookError(Exception):
    """payhook failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__)


class SettingsError(PayhookError):
    """A setting is missing or malformed."""


class DatabaseRoleError(SettingsError):
    """The database refused the role payhook's connections work as."""

    def __init__(self, role: str) -> None:
        super().__init__(
            f"PAYHOOK_DATABASE_ROLE: PostgreSQL refused the role {role!r}: it does not "
            "exist yet (run `payhook migrate`, which creates it) or the role of "
            f"DATABASE_URL may not take it (GRANT {role} TO that role)"
        )


class PoolerError(SettingsError):
    """What a connection needs cannot pass the transaction pooler in between."""


class QueryFileError(PayhookError):
    """A named-query file is malformed."""


class MigrationError(PayhookError):
    """A migration could not be applied."""


class IncompatibleDependency(PayhookError):
    """A dependency no longer has an internal payhook relies on (payhook.compat)."""


class NotFound(PayhookError):
    """No such record."""


class SignatureError(PayhookError):
    """The request is not authentic."""


class MalformedHeaders(SignatureError):
    """The signature headers are missing or malformed."""


class SignatureMismatch(SignatureError):
    """No signature matches any of the endpoint's secrets."""


class TimestampOutOfTolerance(SignatureError):
    """The signed timestamp is too old or too far in the future."""


class UntrustedCertificate(SignatureError):
    """The signing certificate is not one payhook may trust."""


class GatewayUnavailable(PayhookError):
    """The gateway's API did not answer what verifying or reading the event
    needs (a certificate, the resource an event links to): try again later."""


class RateLimited(GatewayUnavailable):
    """The gateway's API asked to be called again later (`429`)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DatabaseError(PayhookError):
    """PostgreSQL failed a statement."""


class MalformedEvent(PayhookError):
    """The authenticated body is not an event payhook can read."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    @property
    def detail(self) -> dict[str, str]:
        """What the exception row records: the field and the reason, never its content."""
        return {"field": self.field, "reason": self.reason}


class ForbiddenJob(PayhookError):
    """The job names a function payhook does not run."""


class RefusedJob(PayhookError):
    """The consumer refused a job it could not verify or read; it applied nothing."""


class UnreadableJob(PayhookError):
    """The job's hash in Redis is not one payhook wrote: it cannot be read as a job."""


class OutcomesMismatch(PayhookError):
    """The database's lists of outcomes and kinds differ from payhook's."""
