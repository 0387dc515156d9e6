"""A TCP proxy that delays every byte by a fixed time each way: a server on this host timed as if
it were across a network. No Django.

    python -m loadtest.latency_proxy --listen 55432 --to 127.0.0.1:5432 --delay-ms 0.5

Every connection made to 127.0.0.1:--listen is relayed to --to; what either side sends reaches
the other --delay-ms later, in order (a round trip gains twice --delay-ms). Point a benchmark's
`DATABASE_URL` at the listening port to time a database that far away (a batch's statement
across a network, say). It runs on the cores it measures: its own CPU falls in every
contender's figures alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader to writer, each chunk `delay` seconds after it was read, in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    delivering = asyncio.create_task(deliver())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((loop.time() + delay, data))
    except OSError:
        pass
    finally:
        queue.put_nowait((0.0, b""))
        with contextlib.suppress(OSError):
            await delivering


async def _serve_one(
    client_reader: asyncio.StreamReader,
    client_writer: asyncio.StreamWriter,
    host: str,
    port: int,
    delay: float,
) -> None:
    try:
        server_reader, server_writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        print(f"latency proxy: cannot reach {host}:{port}: {exc}", file=sys.stderr, flush=True)
        client_writer.close()
        return
    try:
        await asyncio.gather(
            _relay(client_reader, server_writer, delay),
            _relay(server_reader, client_writer, delay),
        )
    finally:
        client_writer.close()
        server_writer.close()


async def serve(listen: int, host: str, port: int, delay: float, ready: asyncio.Event) -> None:
    """Relay connections to 127.0.0.1:`listen` to `host`:`port`, `delay` seconds each way."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _serve_one(reader, writer, host, port, delay)

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        ready.set()
        await server.serve_forever()


def _target(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is not host:port")
    return host, int(port)


def _port(value: str) -> int:
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port (1 to 65535)")
    return int(value)


def _delay(value: str) -> float:
    try:
        delay = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of milliseconds") from None
    if not 0 <= delay <= 1000:
        raise argparse.ArgumentTypeError(f"the delay must be from 0 to 1000 ms, not {value}")
    return delay


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.latency_proxy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--listen", type=_port, required=True, help="port on 127.0.0.1")
    parser.add_argument("--to", type=_target, required=True, help="host:port to relay to")
    parser.add_argument(
        "--delay-ms", type=_delay, required=True, help="delay each way, ms (0 to 1000)"
    )
    args = parser.parse_args(argv)
    host, port = args.to
    ready = asyncio.Event()

    async def run() -> None:
        serving = asyncio.create_task(serve(args.listen, host, port, args.delay_ms / 1000, ready))
        listening = asyncio.create_task(ready.wait())
        await asyncio.wait([serving, listening], return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            serving.result()  # raises why it could not listen
        print(
            f"relaying 127.0.0.1:{args.listen} to {host}:{port}, {args.delay_ms} ms each way",
            flush=True,
        )
        await serving

    try:
        asyncio.run(run())
    except OSError as exc:
        print(f"latency proxy: cannot listen on 127.0.0.1:{args.listen}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
