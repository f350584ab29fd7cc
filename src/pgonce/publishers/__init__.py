"""Publishers: the outbox relay's broker clients, each behind one small interface.

The interface is :class:`pgonce.publishers.base.Publisher`.

Every publisher sends the outbox id as the message id, publishes a batch in the order given, and
reports which ids the broker acknowledged. Each lives in its own module so that importing one does
not import the others' client libraries.
"""
