"""The feed: how each rank gets its batches, from a queue the main process fills or from data it reads itself.

One module a concept: the training data as fit() takes it (data.py); the queue transport, a feeder
thread putting batches into shared queues (queue.py) through shared-memory slots (slots.py); what
spawned workers are sent once per fit to read themselves (epochs.py), each worker claiming its
batches first-come (claims.py) or reading its dealt shard (shard.py), as torchrun's ranks and one
worker in the caller's process read the data they hold.
"""
