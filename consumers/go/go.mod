module faultline.dev/consumer

go 1.26
