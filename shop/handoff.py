"""gunicorn's sync worker, able to hand a request's connection to the sale writer.

A `lua` or `segmented` checkout sent to the sale writer (`inventory.writer`) waits for its
batch's commit. On a plain sync worker the web process waits with it, one checkout at a time:
eight web processes keep at most eight sales in flight, and each one that waits is woken again
to send an answer it only relays. This worker lets the checkout's view give the client's
connection to the writer instead: the view says what to send (`inventory.writer.HandOff`, in the
request's environ under HAND_OFF) and returns; once the middleware has added its headers to the
view's placeholder answer, the worker sends the sale, those headers and the connection's file
descriptor to the writer (`HandOff.send`, SCM_RIGHTS on the writer's unix socket), closes its
own descriptor without shutting the connection down, and takes the next request. The writer
answers the client once the sale's order row is committed (docs/design.md, "The writer answers
the buyer").

When nothing could be sent (no writer listening), the request is served again in this worker
with no hand-off (DIRECT in its environ), from the body the view read: the checkout sells the
direct way, as it does on a plain sync worker. Every other request is served as the sync
worker serves it.
"""

from __future__ import annotations

import errno
import io
import ssl
import sys
from datetime import datetime
from typing import Any

from gunicorn import http, sock, util
from gunicorn.http import wsgi
from gunicorn.workers.sync import SyncWorker


class _HandedOff(Exception):
    """The writer has the connection: nothing more to write, and no graceful close."""


class HandOffWorker(SyncWorker):
    """gunicorn's SyncWorker whose requests may hand their connection to the sale writer."""

    def load_wsgi(self) -> None:
        super().load_wsgi()
        # The environ keys, from the app's package, once it is loaded (it needs Django set up).
        from inventory import writer

        self.keys = (writer.CLIENT, writer.HAND_OFF, writer.DIRECT)

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        req = None
        handed = False
        try:
            if self.cfg.is_ssl:
                client = sock.ssl_wrap_socket(client, self.cfg)
            parser = http.get_parser(self.cfg, client, addr)
            req = next(parser)
            self.handle_request(listener, req, client, addr)
        except _HandedOff:
            handed = True
        except http.errors.NoMoreData as e:
            self.log.debug("Ignored premature client disconnection. %s", e)
        except StopIteration as e:
            self.log.debug("Closing connection. %s", e)
        except ssl.SSLError as e:
            if e.args[0] == ssl.SSL_ERROR_EOF:
                client.close()
            else:
                self.handle_error(req, client, addr, e)
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                self.log.exception("Socket error processing request.")
        except BaseException as e:
            self.handle_error(req, client, addr, e)
        finally:
            if handed:
                # Only this process's descriptor: the writer's keeps the connection open.
                client.close()
            else:
                util.close_graceful(client)

    def handle_request(self, listener: Any, req: Any, client: Any, addr: Any) -> None:
        environ: dict[str, Any] = {}
        resp = None
        try:
            self.cfg.pre_request(self, req)
            request_start = datetime.now()
            resp, environ = wsgi.create(req, client, addr, listener.getsockname(), self.cfg)
            resp.force_close()
            self.nr += 1
            if self.nr >= self.max_requests:
                self.log.info("Autorestarting worker after current request.")
                self.alive = False
            client_key, hand_off_key, direct_key = self.keys
            if not self.cfg.is_ssl:
                environ[client_key] = client
            respiter = self.wsgi(environ, resp.start_response)
            hand_off = environ.get(hand_off_key)
            if hand_off is not None:
                if hasattr(respiter, "close"):
                    respiter.close()
                if hand_off.send(client, resp):
                    self.log.access(resp, req, environ, datetime.now() - request_start)
                    raise _HandedOff
                # Nothing was sent: serve it again, the direct way.
                resp = wsgi.Response(req, client, self.cfg)
                resp.force_close()
                environ = {
                    **environ,
                    "wsgi.input": io.BytesIO(hand_off.body),
                    direct_key: True,
                    hand_off_key: None,
                }
                respiter = self.wsgi(environ, resp.start_response)
            try:
                if isinstance(respiter, environ["wsgi.file_wrapper"]):
                    resp.write_file(respiter)
                else:
                    for item in respiter:
                        resp.write(item)
                resp.close()
            finally:
                request_time = datetime.now() - request_start
                self.log.access(resp, req, environ, request_time)
                if hasattr(respiter, "close"):
                    respiter.close()
        except (OSError, _HandedOff):
            util.reraise(*sys.exc_info())
        except (Exception, SystemExit):
            if resp and resp.headers_sent:
                self.log.exception("Error handling request")
                util.close_graceful(client)
                raise StopIteration() from None
            raise
        finally:
            try:
                self.cfg.post_request(self, req, environ, resp)
            except Exception:
                self.log.exception("Exception in post_request hook")
