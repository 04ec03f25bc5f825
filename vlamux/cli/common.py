"""What every `vlamux` command shares: the SDK client from the global options, one-line errors,
tables."""

from __future__ import annotations

import json
import sys
import time

import click

DEFAULT_URL = "http://127.0.0.1:8321"


class Group(click.Group):
    """Turns the SDK's errors into one line on stderr and exit status 1, without a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as e:  # noqa: BLE001 - everything else is reported, not dumped
            fail(e)


def fail(e: Exception) -> None:
    from vlamux.sdk.errors import AuthenticationError, ServiceUnavailableError, VlamuxAPIError

    if isinstance(e, AuthenticationError) and "missing" in e.message:
        msg = f"error: no API key: pass --key or set VLAMUX_API_KEY [{e.status} {e.type}]"
    elif isinstance(e, ServiceUnavailableError):
        msg = f"error: cannot reach the service: {e.message}"
    elif isinstance(e, VlamuxAPIError):
        msg = f"error: {e.message}"
        if e.field and not e.message.startswith(f"{e.field}:"):
            msg += f" (field: {e.field})"
        if e.status:
            msg += f" [{e.status} {e.type}]"
    elif isinstance(e, (FileNotFoundError, ValueError, KeyError, RuntimeError, OSError)):
        msg = f"error: {e}"
    else:
        msg = f"error: {type(e).__name__}: {e}"
    click.echo(msg, err=True)
    sys.exit(1)


def client(ctx: click.Context, key: str | None = None):
    from vlamux.sdk import Client

    obj = ctx.find_root().obj
    return Client(obj["url"], api_key=key or obj["key"] or "", timeout_s=obj["timeout"],
                  max_retries=obj["max_retries"])


def table(rows: list[dict], columns: list[str]) -> None:
    if not rows:
        click.echo("(none)")
        return
    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    click.echo("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "-"
