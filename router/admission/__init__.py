"""Load admission: who a request is for and whether it goes to the workers now, later or not at all, decided before
any worker holds anything for it (the `admission:` and `tenants:` config). The tenant of an API key and its quotas
(`tenants`), a priority class's queue, weighted fair across tenants (`fair_queue`), the wait a new request would have
at the prefills, from what is booked on them and their measured rates (`queue_wait`), and the gate that admits, queues
or refuses with a 429 and Retry-After by that wait (`gate`). Not the canary that admits a new worker: that is the PD
core's (router/pd/admission.py)."""
