#!/usr/bin/env python3
"""A gRPC client that knows no proto file: it asks the server for its descriptors through server
reflection (as grpcurl does), lists the services, and calls moelora.v1.Controller methods with
requests built from JSON.

    reflection_client.py HOST:PORT list
    reflection_client.py HOST:PORT call moelora.v1.Controller/Generate '{"prompt_token_ids": [1, 2], "max_tokens": 4}'

Needs grpcio, grpcio-reflection and protobuf (pip). Used by tests/integration/reflection_test.sh.
"""
import json
import sys

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    channel = grpc.insecure_channel(argv[1])
    db = ProtoReflectionDescriptorDatabase(channel)
    pool = descriptor_pool.DescriptorPool(db)
    if argv[2] == "list":
        for name in db.get_services():
            print(name)
        return 0
    if argv[2] == "call" and len(argv) == 5:
        service_name, method_name = argv[3].split("/")
        service = pool.FindServiceByName(service_name)
        method = service.FindMethodByName(method_name)
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        request = json_format.Parse(argv[4], request_cls())
        call = channel.unary_unary(
            f"/{service_name}/{method_name}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        response = call(request, timeout=60)
        print(json.dumps(json_format.MessageToDict(response, preserving_proto_field_name=True)))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
