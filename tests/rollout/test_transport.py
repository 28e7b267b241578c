"""Weights over a group of their own (rollout/transport.py): packing, a real gloo group, bucket checks.

The sender and the receiver are two threads of this process, each with its own TCPStore client and
ProcessGroupGloo: the same objects and the same wire protocol as between a trainer rank and an
engine's worker, without the process start-up.
"""
import threading

import pytest
import torch

from hacpo_megatron.rollout.base import weight_buckets
from hacpo_megatron.rollout.embedded import EmbeddedEngine, hf_model_from_config
from hacpo_megatron.rollout.transport import (
    ALIGNMENT, BucketReceiver, WeightTransportError, broadcast, join_group, open_group, pack_bucket, unpack_bucket,
)
from hacpo_megatron.models.presets import load_hf_config_dict


def mixed_bucket():
    generator = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, 5, generator=generator)),
            ("b.bias", torch.randn(7, generator=generator).to(torch.bfloat16)),
            ("c.scale", torch.tensor(2.5, dtype=torch.float64)),
            ("d.index", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
            ("e.half", torch.randn(4, 2, generator=generator).to(torch.float16).t())]  # not contiguous


def test_a_packed_bucket_unpacks_to_the_same_tensors_bit_for_bit():
    bucket = mixed_bucket()
    header, flat = pack_bucket(bucket, index=3)
    payload = sum(t.numel() * t.element_size() for _, t in bucket)
    # every tensor starts aligned (a view of a byte buffer must), so a little padding is allowed
    assert flat.dtype == torch.uint8 and flat.numel() == header.nbytes
    assert payload <= header.nbytes < payload + ALIGNMENT * len(bucket)
    assert header.index == 3 and header.names == tuple(name for name, _ in bucket)
    unpacked = unpack_bucket(header, flat.clone())
    assert [name for name, _ in unpacked] == [name for name, _ in bucket]
    for (_, sent), (_, got) in zip(bucket, unpacked):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)


class Pair:
    """A two-member weight group: `sender` (rank 0) in this thread, the receiver side in a thread."""

    def __init__(self):
        address, store = open_group(2, "gloo", "127.0.0.1")
        joined = {}
        thread = threading.Thread(target=lambda: joined.update(group=join_group(address, 1)))
        thread.start()
        self.sender = join_group(address, 0, store)
        thread.join(timeout=60)
        self.receiver = BucketReceiver(joined["group"])

    def send(self, buckets, indices):
        """Broadcast `buckets` with the given indices while the receiver takes them; returns
        (received tensors, the receiver's error or None)."""
        received, errors = [], []

        def receive(headers):
            try:
                for header in headers:
                    received.extend(self.receiver.receive(header))
            except WeightTransportError as error:
                errors.append(error)

        packed = [pack_bucket(bucket, index) for bucket, index in zip(buckets, indices)]
        thread = threading.Thread(target=receive, args=([header for header, _ in packed],))
        thread.start()
        for _header, flat in packed:
            broadcast(self.sender, flat)  # must return even when the receiver refuses the bucket
            if errors:
                break
        thread.join(timeout=60)
        assert not thread.is_alive(), "the receiver hangs"
        return received, (errors[0] if errors else None)


@pytest.fixture
def pair():
    return Pair()


def buckets_of(named, bucket_bytes=64):
    return list(weight_buckets(named, bucket_bytes))


def test_buckets_broadcast_in_a_gloo_group_arrive_whole(pair):
    named = mixed_bucket()
    buckets = buckets_of(named)
    assert len(buckets) >= 3
    received, error = pair.send(buckets, range(len(buckets)))
    assert error is None
    pair.receiver.finish(len(buckets))
    assert [name for name, _ in received] == [name for name, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(received, named))
    # the receiver is ready for the next update: indices start again at 0
    received, error = pair.send(buckets[:1], [0])
    assert error is None and len(received) == len(buckets[0])


def test_a_dropped_bucket_is_refused(pair):
    buckets = buckets_of(mixed_bucket())
    _, error = pair.send([buckets[0], buckets[2]], [0, 2])  # bucket 1 never sent
    assert error is not None and "dropped" in str(error)


def test_a_bucket_sent_twice_is_refused(pair):
    buckets = buckets_of(mixed_bucket())
    _, error = pair.send([buckets[0], buckets[0]], [0, 0])
    assert error is not None and "sent twice" in str(error)


def test_the_same_weights_under_a_new_index_are_refused(pair):
    buckets = buckets_of(mixed_bucket())
    _, error = pair.send([buckets[0], buckets[0]], [0, 1])
    assert error is not None and "sent twice" in str(error)


def test_a_lost_last_bucket_shows_at_the_end_of_the_update(pair):
    buckets = buckets_of(mixed_bucket())
    _, error = pair.send(buckets[:-1], range(len(buckets) - 1))
    assert error is None  # nothing out of order yet
    with pytest.raises(WeightTransportError, match=f"sent {len(buckets)} weight buckets, {len(buckets) - 1} arrived"):
        pair.receiver.finish(len(buckets))


def test_an_embedded_engine_takes_its_weights_from_the_group():
    config = load_hf_config_dict("tiny-llama")
    source, target = hf_model_from_config(config, seed=1), hf_model_from_config(config, seed=2)
    engine = EmbeddedEngine(target, tokenizer=None, eos_token_ids=[0], pad_token_id=0)
    named = list(source.state_dict().items())
    assert not engine.check_weights(named).equal
    address, store = open_group(2, "gloo", "127.0.0.1")
    thread = threading.Thread(target=engine.join_weight_group, args=(address,))
    thread.start()
    sender = join_group(address, 0, store)
    thread.join(timeout=60)
    buckets = buckets_of(named, bucket_bytes=2**20)
    for index, bucket in enumerate(buckets):
        header, flat = pack_bucket(bucket, index)
        receiving = threading.Thread(target=engine.receive_bucket, args=(header,))
        receiving.start()
        broadcast(sender, flat)
        receiving.join(timeout=60)
    engine.end_bucket_stream(len(buckets))
    check = engine.check_weights(named)
    assert check.equal and check.max_abs_diff == 0.0, check


def test_the_groups_store_listens_on_the_senders_address_only():
    import psutil

    address, store = open_group(2, "gloo", "127.0.0.1")
    listening = [c.laddr for c in psutil.Process().net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == address.port]
    assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", address.port)]  # not 0.0.0.0 / ::
    del store
