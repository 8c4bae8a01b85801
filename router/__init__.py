"""The router: the cluster's only public endpoint. Pairs a prefill with a decode for every request."""
