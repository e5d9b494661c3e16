"""What crosses between ranks: devices under torchrun, transports and the rendezvous, a step's exchange and gradient edges, collectives and running statistics over replicas."""
