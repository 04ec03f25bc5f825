"""Services: the Training, Inference and Environment services, their queues and the runtime that places them."""
