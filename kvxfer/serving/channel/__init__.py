"""The router <-> worker channel, both ends: the router (:mod:`kvxfer.serving.server`) and
the workers (:mod:`kvxfer.serving.workers`) import it, neither imports the other.

- :mod:`.ipc`: the message vocabulary and the private socket pair of a worker that
  ``kvxfer serve`` spawned (and :data:`~.ipc.AGENT_SECRET_ENV`, how it hands that
  worker the agents' secret);
- :mod:`.netchannel`: the same messages over authenticated TCP, for ``kvxfer worker``
  on any host.
"""
