"""The stage service on the network: the stream envelope of stage calls and the gRPC servicer."""
