"""locking.scripts.DirectScript: the scripts of a plain redis.Redis, sent straight down a
connection of its pool, answer and fail exactly as redis-py's Script does.

Against the shared Redis under a key prefix, and a private redis-server for what kills or
pauses one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from locking import scripts
from shop.processes.redis_server import RedisServer
from tests.support import redis_url

#: One script whose answer takes each of Redis's reply types, chosen by ARGV[1].
ANSWERS = """
local kind = ARGV[1]
if kind == 'int' then return redis.call('incrby', KEYS[1], ARGV[2]) end
if kind == 'bulk' then return redis.call('get', KEYS[1]) end
if kind == 'nil' then return redis.call('get', KEYS[2]) end
if kind == 'array' then return {KEYS[1], tonumber(ARGV[2]), false, {'x'}} end
if kind == 'status' then return redis.status_reply('FINE') end
return redis.error_reply('BOOM ' .. kind)
"""


def _client(url: str, **kwargs: object) -> redis.Redis:
    """What the shop builds (inventory.redis_client): short timeouts, no retries; with a pool
    of one connection, so that a call that kept its connection leaves none for the next."""
    kwargs.setdefault("retry", Retry(NoBackoff(), 0))
    kwargs.setdefault("socket_timeout", 2)
    kwargs.setdefault("max_connections", 1)
    return redis.Redis.from_url(url, **kwargs)


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    r = _client(redis_url())
    yield r
    r.close()


def _connection_given_back(r: redis.Redis) -> bool:
    """Whether the pool's one connection is free again: the next command gets it."""
    return r.ping() is True


@pytest.mark.parametrize("kind", ["int", "bulk", "nil", "array", "status"])
def test_it_answers_what_redis_pys_script_answers(client, prefix, kind) -> None:
    direct = scripts.script_for(client, ANSWERS)
    plain = Script(client, ANSWERS)
    assert type(direct) is scripts.DirectScript
    keys = [prefix + "a", prefix + "missing"]
    client.set(keys[0], "5")
    first = direct(keys=keys, args=[kind, 2], client=client)
    client.set(keys[0], "5")
    assert first == plain(keys=keys, args=[kind, 2])
    assert _connection_given_back(client)


def test_an_error_reply_raises_redis_pys_error_and_leaves_the_connection_usable(
    client, prefix
) -> None:
    direct = scripts.script_for(client, ANSWERS)
    with pytest.raises(redis.exceptions.ResponseError, match="BOOM other"):
        direct(keys=[prefix + "a", prefix + "b"], args=["other"])
    assert _connection_given_back(client)
    assert direct(keys=[prefix + "a", prefix + "b"], args=["int", 3]) == 3


def test_a_redis_that_lost_its_scripts_gets_the_script_again(client, prefix) -> None:
    direct = scripts.script_for(client, ANSWERS)
    assert direct(keys=[prefix + "a", prefix + "b"], args=["int", 1]) == 1
    with RedisServer() as server:  # SCRIPT FLUSH on a server of our own, not the shared one
        own = _client(server.url)
        script = scripts.script_for(own, ANSWERS)
        assert script(keys=["a", "b"], args=["int", 1]) == 1
        own.script_flush()
        assert own.script_exists(script.sha) == [False]
        assert script(keys=["a", "b"], args=["int", 1]) == 2
        assert own.script_exists(script.sha) == [True]
        assert _connection_given_back(own)
        own.close()


def test_a_dead_redis_raises_connection_error_and_a_restarted_one_answers_again() -> None:
    with RedisServer() as server:
        own = _client(server.url)
        script = scripts.script_for(own, ANSWERS)
        assert script(keys=["a", "b"], args=["int", 1]) == 1
        server.kill()
        with pytest.raises(redis.exceptions.ConnectionError):
            script(keys=["a", "b"], args=["int", 1])
        server.start()  # empty: no key, no script
        assert _connection_given_back(own)  # (the failed call's, dropped: it connects again)
        assert script(keys=["a", "b"], args=["int", 1]) == 1
        own.close()


def test_a_reply_that_comes_too_late_is_never_read_as_the_next_calls() -> None:
    """A timeout leaves the late reply on its connection: that connection must be dropped, or
    the next call would read the earlier call's answer as its own."""
    with RedisServer() as server:
        own = _client(server.url, socket_timeout=0.3)
        script = scripts.script_for(own, ANSWERS)
        assert script(keys=["a", "b"], args=["int", 1]) == 1
        server.pause()
        resume = threading.Timer(0.6, server.resume)
        resume.start()
        try:
            with pytest.raises(redis.exceptions.TimeoutError):
                script(keys=["a", "b"], args=["int", 10])  # runs once resumed: a = 11
        finally:
            resume.join()
        assert _connection_given_back(own)
        assert script(keys=["a", "b"], args=["int", 100]) == 111
        own.close()


def test_other_clients_keep_redis_pys_script(client, prefix) -> None:
    class Spied(redis.Redis):
        pass

    spied = Spied.from_url(redis_url(), retry=Retry(NoBackoff(), 0))
    assert type(scripts.script_for(spied, ANSWERS)) is Script
    single = _client(redis_url(), single_connection_client=True)
    assert type(scripts.script_for(single, ANSWERS)) is Script
    retrying = redis.Redis.from_url(redis_url())  # redis-py's default: retries what fails
    assert type(scripts.script_for(retrying, ANSWERS)) is Script
    # A pipeline passed in queues the call, as with redis-py's Script.
    direct = scripts.script_for(client, ANSWERS)
    pipe = client.pipeline()
    direct(keys=[prefix + "p", prefix + "q"], args=["int", 4], client=pipe)
    direct(keys=[prefix + "p", prefix + "q"], args=["int", 4], client=pipe)
    assert pipe.execute() == [4, 8]
    for other in (spied, single, retrying):
        other.close()
