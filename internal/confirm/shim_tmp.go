package confirm

import amqp "github.com/rabbitmq/amqp091-go"

func tableSize(t amqp.Table) (int, error) { return 0, nil }
