"""Process groups and rendezvous: the stores a job meets through (:mod:`~distopt.dist.rendezvous`),
the trainers' gloo group (:mod:`~distopt.dist.group`), the interface a process listens on
(:mod:`~distopt.dist.netif`), a process's place in its job (:mod:`~distopt.dist.env`), and hosts
made of network namespaces on one machine, with shaped links (:mod:`~distopt.dist.netns`)."""
